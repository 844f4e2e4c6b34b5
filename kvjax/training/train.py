"""LM + MTP draft-head training with optax, held-out bits per byte, MTP acceptance.

A batch is int32 [B, T+1] windows of the byte stream: inputs are the first T
tokens, the trunk predicts tokens 1..T and MTP module k (1-based) predicts
tokens k+1..T from its first T-k positions (`kvjax.model.decoder.forward_with_mtp`).

  loss = CE(trunk) + mtp_weight * sum_k CE(mtp module k)

MTP greedy acceptance (claim C10, temperature 0) is measured exactly for greedy
speculative decoding: the trunk greedily continues held-out prompts, and on that
sequence the draft of module k at position t (context x_{<=t+1}) is accepted iff
it equals the trunk's greedy token x_{t+k+1} and every earlier draft of the same
step was accepted (module k>1 then sees the accepted draft as its input, i.e. the
same token the teacher-forced forward feeds it).  Averaged over every position
of the continuation, a step emits 1 + sum_k P(drafts 1..k accepted) tokens.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from kvjax.model.config import ModelConfig
from kvjax.model.decoder import forward, forward_with_mtp
from kvjax.model.params import Params, init_params
from kvjax.text.tokenizer import ByteTokenizer

__all__ = ["TrainState", "make_optimizer", "init_train_state", "loss_fn", "make_train_step",
           "bits_per_byte", "greedy_continuation", "mtp_acceptance"]


@struct.dataclass
class TrainState:
  step: jax.Array  # [] int32
  params: Params
  opt_state: Any  # optax state of `params`


def make_optimizer(learning_rate: float, warmup_steps: int, total_steps: int,
                   end_lr_fraction: float = 0.1, weight_decay: float = 0.1,
                   grad_clip: float = 1.0, b2: float = 0.95) -> optax.GradientTransformation:
  """AdamW on a linear-warmup + cosine schedule, after global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=learning_rate, warmup_steps=warmup_steps,
      decay_steps=max(total_steps, warmup_steps + 1),
      end_value=learning_rate * end_lr_fraction)
  # No weight decay on norm gains (1-D leaves).
  decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim > 1, params)
  return optax.chain(
      optax.clip_by_global_norm(grad_clip),
      optax.adamw(schedule, b1=0.9, b2=b2, weight_decay=weight_decay, mask=decay_mask))


def init_train_state(cfg: ModelConfig, key: jax.Array,
                     optimizer: optax.GradientTransformation) -> TrainState:
  params = init_params(cfg, key)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=optimizer.init(params))


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """logits [B, T, V], targets [B, T] -> [B, T] nats."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def loss_fn(params: Params, cfg: ModelConfig, batch: jax.Array, mtp_weight: float):
  """batch [B, T+1] -> (loss, metrics {lm_loss, mtp{k}_loss})."""
  inputs = batch[:, :-1]
  t = inputs.shape[1]
  logits, mtp_logits = forward_with_mtp(params, cfg, inputs)
  lm_loss = _cross_entropy(logits, batch[:, 1:]).mean()
  metrics = {"lm_loss": lm_loss}
  loss = lm_loss
  for k, mtp in enumerate(mtp_logits, start=1):
    mtp_loss = _cross_entropy(mtp[:, :t - k], batch[:, k + 1:]).mean()
    metrics[f"mtp{k}_loss"] = mtp_loss
    loss = loss + mtp_weight * mtp_loss
  return loss, metrics


def make_train_step(cfg: ModelConfig, optimizer: optax.GradientTransformation,
                    mtp_weight: float) -> Callable:
  """(state, batch [B, T+1]) -> (state, metrics); jitted, state donated."""

  def train_step(state: TrainState, batch: jax.Array):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, cfg, batch, mtp_weight)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return jax.jit(train_step, donate_argnums=0)


@functools.partial(jax.jit, static_argnums=1)
def _byte_nats(params: Params, cfg: ModelConfig, windows: jax.Array):
  """windows [B, T+1] -> (sum of nats over byte targets, number of byte targets)."""
  nats = _cross_entropy(forward(params, cfg, windows[:, :-1]), windows[:, 1:])
  is_byte = windows[:, 1:] < ByteTokenizer.num_bytes
  return jnp.sum(jnp.where(is_byte, nats, 0.0)), jnp.sum(is_byte)


def bits_per_byte(params: Params, cfg: ModelConfig, windows: np.ndarray,
                  batch_size: int = 16) -> float:
  """Held-out bits per byte of the trunk over windows [W, T+1] (special targets skipped)."""
  total, count = 0.0, 0
  for i in range(0, len(windows), batch_size):
    nats, n = _byte_nats(params, cfg, jnp.asarray(windows[i:i + batch_size]))
    total, count = total + float(nats), count + int(n)
  return total / count / math.log(2)


@functools.partial(jax.jit, static_argnums=(1, 3))
def greedy_continuation(params: Params, cfg: ModelConfig, prompts: jax.Array,
                        num_new: int) -> jax.Array:
  """prompts [B, P] -> [B, P + num_new]: the trunk's greedy continuation (no cache)."""
  b, p = prompts.shape
  seqs = jnp.pad(prompts, ((0, 0), (0, num_new)))

  def body(i, seqs):
    logits = forward(params, cfg, seqs)  # causal: rows after p+i-1 do not matter
    next_token = jnp.argmax(logits[:, p + i - 1], axis=-1).astype(seqs.dtype)
    return seqs.at[:, p + i].set(next_token)

  return jax.lax.fori_loop(0, num_new, body, seqs)


@functools.partial(jax.jit, static_argnums=(1, 3))
def _accepted(params: Params, cfg: ModelConfig, seqs: jax.Array, prompt_len: int):
  """seqs [B, T] greedy from `prompt_len` -> bool [J, B, positions]: drafts 1..j accepted."""
  _, mtp_logits = forward_with_mtp(params, cfg, seqs)
  num_drafts, s = len(mtp_logits), seqs.shape[1]
  first, last = prompt_len - 2, s - num_drafts - 2  # every target x_{t+k+1} is greedy
  all_so_far = jnp.ones((seqs.shape[0], last - first + 1), bool)
  accepted = []
  for k, mtp in enumerate(mtp_logits, start=1):
    draft = jnp.argmax(mtp[:, first:last + 1], axis=-1)
    all_so_far &= draft == seqs[:, first + k + 1:last + k + 2]
    accepted.append(all_so_far)
  return jnp.stack(accepted)


def mtp_acceptance(params: Params, cfg: ModelConfig, prompts: np.ndarray,
                   num_new: int) -> dict:
  """Greedy MTP acceptance on the trunk's continuations of held-out prompts [B, P].

  Returns per_position: P(drafts 1..k all accepted) for k = 1..K (a draft after a
  rejection counts as rejected), per_head: P(draft k accepted | drafts < k accepted),
  and mean_accepted_length: tokens per verify step, 1 + sum(per_position), of K+1.
  """
  if not cfg.mtp_num_hidden_layers:
    raise ValueError(f"config {cfg.name!r} has no MTP modules (mtp_num_hidden_layers=0)")
  prompts = jnp.asarray(prompts, jnp.int32)
  seqs = greedy_continuation(params, cfg, prompts, num_new)
  accepted = np.asarray(_accepted(params, cfg, seqs, prompts.shape[1]))
  per_position = accepted.reshape(accepted.shape[0], -1).mean(axis=1)
  previous = np.concatenate([[1.0], per_position[:-1]])
  return {"per_position": [float(x) for x in per_position],
          "per_head": [float(a / b) if b else 0.0 for a, b in zip(per_position, previous)],
          "mean_accepted_length": float(1.0 + per_position.sum()),
          "num_drafts": int(accepted.shape[0]),
          "num_steps_measured": int(accepted.shape[1] * accepted.shape[2])}
