"""Training pipeline: corpus split, smoke training, exact resume, checkpoint roundtrip."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_code
from experiments import train as launcher
from kvjax.model.params import init_params
from kvjax.text.tokenizer import ByteTokenizer
from kvjax.training import code_corpus
from kvjax.training import corpus as corpus_lib
from kvjax.training import train as train_lib
from kvjax.weights import checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke_config(**changes):
  config = tiny_code.get_config("runlocal")
  config.log_every = 1
  config.update(changes)
  return config


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  """30 uninterrupted smoke steps, exported: (workdir, export dir, history)."""
  workdir = str(tmp_path_factory.mktemp("full"))
  export_dir = os.path.join(workdir, "export")
  history = launcher.train_and_evaluate(smoke_config(export_dir=export_dir), workdir)
  return workdir, export_dir, history


def test_corpus_split_is_disjoint_and_deterministic():
  corpus = corpus_lib.load_corpus(heldout_fraction=0.25, max_files=40)
  assert corpus == corpus_lib.load_corpus(heldout_fraction=0.25, max_files=40)
  paths = [f.path for f in corpus.files]
  assert paths == sorted(paths) and len(paths) == 40
  train = {f.path for f in corpus.split_files("train")}
  heldout = {f.path for f in corpus.split_files("heldout")}
  assert train and heldout and not train & heldout
  assert not any("site-packages" in p or p.startswith("test/") for p in paths)
  # The train stream is exactly the train files: no held-out byte in it.
  stream = corpus_lib.split_tokens(corpus, "train")
  assert len(stream) == sum(f.num_bytes + 2 for f in corpus.split_files("train"))


def test_smoke_training_loss_goes_down(full_run):
  _, _, history = full_run
  losses = [h["loss"] for h in history]
  assert [h["step"] for h in history] == list(range(1, 31))
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 1.0, losses
  assert history[-1]["heldout_bits_per_byte"] < history[14]["heldout_bits_per_byte"]


def test_resume_continues_the_same_loss_curve(full_run, tmp_path):
  _, _, history = full_run
  workdir = str(tmp_path)
  first = launcher.train_and_evaluate(smoke_config(stop_at_step=20), workdir)
  resumed = launcher.train_and_evaluate(smoke_config(), workdir)
  assert [h["step"] for h in first] == list(range(1, 21))
  assert [h["step"] for h in resumed] == list(range(21, 31))
  np.testing.assert_array_equal([h["loss"] for h in first + resumed],
                                [h["loss"] for h in history])


def test_export_roundtrip_equals_trained_state(full_run):
  workdir, export_dir, _ = full_run
  config = smoke_config()
  cfg = launcher.model_config(config)
  optimizer = train_lib.make_optimizer(config.learning_rate, config.warmup_steps,
                                       config.total_steps)
  target = train_lib.init_train_state(cfg, jax.random.PRNGKey(1), optimizer)
  state, progress = checkpoint.restore_train_state(
      checkpoint.train_state_manager(os.path.join(workdir, "ckpt")), target)
  assert int(state.step) == 30 and progress["train_seconds"] > 0
  restored_cfg, params = checkpoint.restore(export_dir)
  assert restored_cfg == cfg
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, state.params)
  card = checkpoint.read_metadata(export_dir)
  assert card["training"]["steps"] == 30 and card["params"] > 0
  for name in ("MODEL_CARD.md", "model_card.json"):
    assert os.path.exists(os.path.join(export_dir, name))
  _check_eval_slices(export_dir, card)


def _check_eval_slices(export_dir, card):
  """The exported slices are the ones the card's numbers were measured on."""
  slices = np.load(os.path.join(export_dir, "eval_slices.npz"))
  for name, record in card["eval"]["sets"].items():
    fixed = record["slice"]
    assert corpus_lib.tokens_sha256(slices[f"{name}_windows"]) == fixed["sha256"]
    assert corpus_lib.tokens_sha256(slices[f"{name}_prompts"]) == fixed["prompts_sha256"]
    assert slices[f"{name}_windows"].shape == (fixed["windows"], fixed["seq_len"] + 1)
  signatures = card["eval"]["signatures"]
  assert signatures["num_parsed"] == sum(signatures["parsed"])
  assert all(s.startswith("def ") and s.endswith(":\n") for s in signatures["signatures"])


def _code_pack(tmp_path):
  """A manifest + pack from real stdlib files: train (stdlib), held-out and unseen packages."""
  stdlib = corpus_lib.load_corpus(heldout_fraction=0.0, max_files=60)
  root = stdlib.root
  files = [(f.path, open(os.path.join(root, f.path), "rb").read()) for f in stdlib.files]
  sources = [code_corpus.Source(code_corpus.STDLIB, "3", tuple(files[:40]), {}),
             code_corpus.Source("heldpkg", "1.0", tuple(files[40:50]), {}),
             code_corpus.Source("unseenpkg", "1.0", tuple(files[50:]), {})]
  # heldout_fraction 1: every package but the stdlib and the unseen one is held out.
  built = code_corpus.build(sources, 1.0, ("unseenpkg",), 0.7)
  record = code_corpus.manifest(built, [{"name": s.name, "version": s.version}
                                        for s in sources], {})
  manifest_path, pack_path = tmp_path / "manifest.json", tmp_path / "pack.zip"
  manifest_path.write_text(code_corpus.manifest_json(record))
  code_corpus.write_pack(built, str(pack_path))
  return str(manifest_path), str(pack_path), built


def test_continued_training_on_the_code_corpus(full_run, tmp_path):
  _, stage1, history = full_run
  manifest, pack, built = _code_pack(tmp_path)
  config = smoke_config(corpus="code", corpus_manifest=manifest, corpus_pack=pack,
                        init_from=stage1, total_steps=10, export_dir=str(tmp_path / "out"))
  data = launcher.load_data(config)
  tok = ByteTokenizer()
  for split, tokens in [("train", data.train), *data.evals.items()]:
    expected = [t for f in built.split_files(split)
                for t in (tok.bos_id, *built.data[f"{f.package}/{f.path}"], tok.eos_id)]
    np.testing.assert_array_equal(tokens, expected)
  assert list(data.evals) == ["heldout", "unseen"]

  cfg = launcher.model_config(config)
  optimizer = train_lib.make_optimizer(config.learning_rate, config.warmup_steps,
                                       config.total_steps)
  _, stage1_params = checkpoint.restore(stage1)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         launcher.initial_state(config, cfg, optimizer).params, stage1_params)
  continued = launcher.train_and_evaluate(config, str(tmp_path / "work"))
  # Starts where stage 1 ended, far below a fresh model's first loss.
  assert continued[0]["loss"] < history[0]["loss"] - 1.0
  card = checkpoint.read_metadata(config.export_dir)
  assert card["training"]["init_from"]["training"]["steps"] == 30
  assert card["corpus"]["splits"]["unseen"]["packages"] == ["unseenpkg"]
  _check_eval_slices(config.export_dir, card)
  assert "unseen: bits/byte" in open(os.path.join(config.export_dir, "MODEL_CARD.md")).read()

  other = launcher.model_config(smoke_config()).replace(name="other", num_layers=2)
  checkpoint.save(str(tmp_path / "other"), other, init_params(other, jax.random.PRNGKey(0)))
  with pytest.raises(ValueError, match="differs"):
    launcher.initial_state(smoke_config(init_from=str(tmp_path / "other")), cfg, optimizer)


def test_checkpoint_restores_in_a_fresh_process_and_casts(tmp_path):
  cfg = launcher.model_config(smoke_config())
  params = init_params(cfg, jax.random.PRNGKey(3))
  checkpoint.save(str(tmp_path), cfg, params, metadata={"note": "roundtrip"})
  checksum = float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree_util.tree_leaves(params)))
  code = ("import jax, jax.numpy as jnp; from kvjax.weights import checkpoint; "
          f"cfg, p = checkpoint.restore({str(tmp_path)!r}); "
          "print(cfg.name, float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree_util.tree_leaves(p))))")
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       check=True).stdout.split()
  assert out[0] == cfg.name and float(out[1]) == pytest.approx(checksum, rel=1e-6)
  _, bf16 = checkpoint.restore(str(tmp_path), dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(bf16))
  assert checkpoint.read_metadata(str(tmp_path)) == {"note": "roundtrip"}
