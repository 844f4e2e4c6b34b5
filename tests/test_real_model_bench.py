"""experiments/real_model_bench.py: its pure helpers against hand-computed values, and the
runlocal config end to end on a tiny GGUF without peers (transformers, on the same file,
must decode the same greedy tokens as kvjax float32)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments import real_model_bench as bench
from tests import test_gguf

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_token_timing():
  # tokens at 0.5, 0.6, 0.8 s after a request sent at 0: TTFT 0.5, TPOT (0.8 - 0.5) / 2
  ttft, tpot = bench.token_timing(10.0, [10.5, 10.6, 10.8])
  assert ttft == pytest.approx(0.5) and tpot == pytest.approx(0.15)
  assert bench.token_timing(1.0, [1.25]) == (0.25, None)
  with pytest.raises(ValueError, match="no tokens"):
    bench.token_timing(0.0, [])


def test_batch1_summary():
  # mean TTFT (0.1 + 0.3) / 2, mean TPOT (0.02 + 0.03) / 2 = 0.025 -> 40 tok/s
  got = bench.batch1_summary([(0.1, 0.02), (0.3, 0.03)])
  assert got == pytest.approx({"ttft_s": 0.2, "tpot_s": 0.025, "decode_tokens_per_s": 40.0})


@pytest.mark.parametrize("a, b, n", [([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2),
                                     ([5], [6], 0), ([], [1], 0), ([7, 8], [7, 8], 2)])
def test_shared_prefix(a, b, n):
  assert bench.shared_prefix(a, b) == n


def test_llama_server_argv():
  assert bench.llama_server_argv("/p/llama-server", "/m.gguf", 32, 256, 2, 8080) == [
      "/p/llama-server", "-m", "/m.gguf", "-np", "32", "-c", "8192", "--threads", "2",
      "--threads-batch", "2", "--ignore-eos", "--host", "127.0.0.1", "--port", "8080"]


def test_find_peers(tmp_path):
  assert bench.find_peers(str(tmp_path)) == {"llamacpp_python": None, "llama_server": None}
  server = tmp_path / "llama-server"
  server.write_text("#!/bin/sh\n")
  server.chmod(0o755)
  (tmp_path / "llamacpp-venv" / "bin").mkdir(parents=True)
  (tmp_path / "llamacpp-venv" / "bin" / "python").write_text("")  # not executable
  assert bench.find_peers(str(tmp_path)) == {"llamacpp_python": None,
                                             "llama_server": str(server)}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  """A tiny llama GGUF with the byte vocabulary (it loads with kvjax's ByteTokenizer and
  its chat template; llama.vocab_size tells transformers the vocabulary) -> its path."""
  path = str(tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf")
  with pytest.MonkeyPatch.context() as patch:
    patch.setitem(test_gguf.ARCH_CONFIGS, "llama", test_gguf.TINY.replace(
        vocab_size=259, bos_token_id=256, eos_token_id=257))
    test_gguf.write_tiny_gguf(path, "llama", "Q4_1", metadata={"llama.vocab_size": 259})
  return path


def _run(checkpoint: str, out, *flags) -> tuple:
  """The runlocal config, no peers -> (results JSON, stdout).  Its XLA compiles at LLVM
  -O0: the tiny model's run is compile bound (-O0 halves each compile), its timings mean
  nothing, and what is checked (tokens, counts, the files) does not depend on it."""
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                     " --xla_backend_optimization_level=0")}
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.real_model_bench",
       "--config=configs/real_model_bench.py:runlocal", f"--config.checkpoint={checkpoint}",
       f"--config.out_dir={out}", f"--config.peers_dir={out / 'no-peers'}", *flags],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out / "real_model_bench_runlocal.json") as f:
    results = json.load(f)
  assert os.path.getsize(out / "real_model_bench_runlocal.png") > 0
  return results, proc.stdout


@pytest.fixture(scope="module")
def runlocal(tiny_gguf, tmp_path_factory):
  return _run(tiny_gguf, tmp_path_factory.mktemp("real_model_bench"))


def test_runlocal_without_peers_says_the_install_command(runlocal):
  results, stdout = runlocal
  assert "experiments/install_cpu_peers.sh" in stdout and "no-peers" in stdout
  assert results["peers"] == {"llamacpp_python": None, "llama_server": None}
  assert results["llama_cpp_python"] is None


def _check_batch1(results, engines) -> None:
  a, c = results["a"], results["config"]
  assert set(a["engines"]) == engines
  for row in a["engines"].values():
    assert [len(t) for t in row["tokens"]] == [c["new_tokens"]] * len(c["prompts"])
    assert row["decode_tokens_per_s"] == pytest.approx(1.0 / row["tpot_s"])
    assert row["ttft_s"] > 0


def test_runlocal_batch1_engines(runlocal):
  _check_batch1(runlocal[0], {"kvjax float32"})


@pytest.mark.slow
def test_runlocal_with_transformers_decodes_kvjax_tokens(tiny_gguf, tmp_path):
  """transformers on the same file (its own GGUF dequantization), float32, greedy: the
  same tokens as kvjax float32 for every prompt."""
  results, _ = _run(tiny_gguf, tmp_path, "--config.transformers=True",
                    "--config.weight_dtypes=('float32', 'int8')")
  _check_batch1(results, {"kvjax float32", "kvjax int8", "transformers float32"})
  assert any("int8 / float32 weights" in row["what"] for row in results["table"])
  c = results["config"]
  assert results["a"]["engines"]["transformers float32"]["shared_prefix_with_kvjax"] == [
      c["new_tokens"]] * len(c["prompts"])


def test_runlocal_served_answers_have_max_tokens(runlocal):
  results, _ = runlocal
  b, c = results["b"], results["config"]
  for conc in c["concurrency"]:
    row = b["by_concurrency"][str(conc)]["kvjax float32"]
    assert row["completed"] == conc * c["requests_per_slot"] and row["failed"] == 0
    assert row["every_answer_max_tokens"] and row["output_tokens_per_s"] > 0
  whats = [r["what"] for r in results["table"]]
  assert any(w.startswith("batch-1 decode tok/s, TTFT ms: kvjax float32") for w in whats)
  assert any(w.startswith(f"{conc} concurrent: output tok/s") for w in whats)
