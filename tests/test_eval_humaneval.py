"""kvjax.eval.humaneval: a real problem's canonical solution passes, a wrong one fails, an
infinite loop times out, the sandbox refuses sockets and memory; the cut and the count;
on the real SmolLM2 file, greedy chat replies are transformers' text."""
from __future__ import annotations

import pytest
import torch

import kvjax
from kvjax.eval import humaneval


@pytest.fixture(scope="module")
def problem():
  return humaneval.load_problems(1)[0]


def test_problems_are_the_packaged_164_in_order():
  problems = humaneval.load_problems()
  assert len(problems) == 164
  assert [p["task_id"] for p in problems[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
  assert problems[-1]["task_id"] == "HumanEval/163"
  for bad in (0, 165, True, "3"):
    with pytest.raises(ValueError, match="limit must be"):
      humaneval.load_problems(bad)


def test_correct_and_wrong_completions_score_1_and_0(problem):
  assert problem["entry_point"] == "has_close_elements"
  right = humaneval.check_completion(problem, problem["canonical_solution"])
  wrong = humaneval.check_completion(problem, "    return False\n")
  assert right["passed"] and right["result"] == "passed"
  assert not wrong["passed"] and "AssertionError" in wrong["result"]


def test_an_infinite_loop_times_out(problem):
  out = humaneval.check_completion(problem, "    while True:\n        pass\n", timeout_s=1.0)
  assert not out["passed"] and out["result"] == "timed out after 1.0 s"
  assert out["seconds"] < 10


def test_sandbox_has_no_network_and_bounded_memory(problem):
  net = humaneval.check_completion(
      problem, "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n")
  assert "network access is disabled" in net["result"]
  big = humaneval.check_completion(problem, "    x = bytearray(4 << 30)\n    return True\n",
                                   memory_bytes=1 << 30)
  assert not big["passed"] and "MemoryError" in big["result"]


def test_truncate_at_the_first_stop_sequence():
  body = "    return a + b\n"
  for stop in humaneval.STOP_SEQUENCES:
    assert humaneval.truncate(body + stop + " rest\n    x = 1\n") == body
  assert humaneval.truncate(body) == body
  assert humaneval.truncate("    x = 1\n#c\ndef g(): pass") == "    x = 1"  # the earliest stop


class _ScriptedEngine:
  """Stands in for kvjax.Engine: replies with fixed token lists, records the call."""

  def __init__(self, replies):
    self.replies, self.calls = replies, []

  def generate(self, prompts, max_new_tokens, stop=None):
    from kvjax.runtime.generation import GenerateResult

    self.calls.append((prompts, max_new_tokens, stop))
    return GenerateResult(tokens=self.replies, stats={})


class _CharTokenizer:
  eos_ids = (2,)

  def encode(self, text, add_special_tokens=True):
    return [ord(c) for c in text]

  def decode(self, ids):
    return "".join(map(chr, ids))


def test_evaluate_keeps_every_problem_and_counts_pass_at_1():
  problems = humaneval.load_problems(2)
  tok = _CharTokenizer()
  replies = [tok.encode(problems[0]["canonical_solution"] + "\ndef extra():\n  return 0\n"),
             tok.encode("    return []\n")]
  engine = _ScriptedEngine(replies)
  out = humaneval.evaluate(engine, tok, problems, max_new_tokens=64, progress=False)
  assert engine.calls[0][0][1] == tok.encode(problems[1]["prompt"])  # raw prompt, no template
  assert engine.calls[0][1:] == (64, [2])
  assert [r["passed"] for r in out["problems"]] == [True, False]
  assert out["problems"][0]["completion"] == problems[0]["canonical_solution"]
  assert (out["pass_at_1"], out["passed"], out["count"]) == (0.5, 1, 2)


def _fenced(code: str, lang: str = "python") -> str:
  return f"Here is the function:\n\n```{lang}\n{code}```\n\nIt checks every pair."


def test_chat_replies_become_programs_the_problem_tests_judge():
  """reply_program: a whole function (its imports left out, as models often do), a body
  alone, a bare reply and a block after an unrelated one all pass with the canonical
  solution; prose, or the function with a wrong body, fails."""
  problems = humaneval.load_problems(3)
  first = problems[0]
  signature = first["prompt"][first["prompt"].index("def "):]  # no `from typing import List`
  solution = first["canonical_solution"]
  passing = [_fenced(first["prompt"] + solution), _fenced(signature + solution),
             _fenced(solution), first["prompt"] + solution,
             _fenced("print('an example')\n") + _fenced(signature + solution, "py"),
             "```python\n" + signature + solution]  # an unclosed block (cut by max tokens)
  for reply in passing:
    program = humaneval.reply_program(first, reply)
    assert humaneval.check_program(first, program)["passed"], (reply, program)
  failing = ["The function takes a list of numbers and a threshold.",
             _fenced(signature + "    return False\n")]
  for reply in failing:
    assert not humaneval.check_program(first, humaneval.reply_program(first, reply))["passed"]
  for problem in problems[1:]:  # other problems' canonical functions, fenced
    reply = _fenced(problem["prompt"] + problem["canonical_solution"])
    assert humaneval.check_program(problem, humaneval.reply_program(problem, reply))["passed"]


class _ChatCharTokenizer(_CharTokenizer):
  def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
    return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_evaluate_in_chat_mode_asks_through_the_template_and_runs_the_reply():
  problems = humaneval.load_problems(2)
  tok = _ChatCharTokenizer()
  replies = [tok.encode(_fenced(problems[0]["prompt"] + problems[0]["canonical_solution"])),
             tok.encode("I would sort the list first.")]
  engine = _ScriptedEngine(replies)
  out = humaneval.evaluate(engine, tok, problems, max_new_tokens=64, mode="chat", progress=False)
  want = "<user>" + humaneval.CHAT_REQUEST.format(prompt=problems[1]["prompt"]) + "<assistant>"
  assert engine.calls[0][0][1] == tok.encode(want)
  assert [r["passed"] for r in out["problems"]] == [True, False]
  assert out["problems"][1]["reply"] == "I would sort the list first."
  assert (out["pass_at_1"], out["mode"]) == (0.5, "chat")
  with pytest.raises(ValueError, match="mode must be one of"):
    humaneval.evaluate(engine, tok, problems, mode="raw", progress=False)


@pytest.mark.slow
def test_smollm2_chat_replies_are_transformers_greedy_text(smollm2, smollm2_hf_tokenizer):
  """The harness measures the variant, not itself: on the real SmolLM2 file, kvjax's
  greedy chat replies to a fixed subset (the first two problems, asked side by side in
  one batch) are transformers' text character for character, with transformers' own
  tokenizer and chat template on the same GGUF."""
  model, _, hf, _ = smollm2
  hf_tokenizer = smollm2_hf_tokenizer
  problems = humaneval.load_problems(2)
  new_tokens = 96
  engine = kvjax.Engine(model, max_num_seqs=2, max_model_len=512)
  replies = humaneval.complete(engine, model.tokenizer, problems, new_tokens, mode="chat")
  for problem, reply in zip(problems, replies):
    ids = hf_tokenizer.apply_chat_template(humaneval.chat_messages(problem),
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    assert ids[0].tolist() == humaneval.prompt_ids(model.tokenizer, problem, "chat")
    with torch.no_grad():
      out = hf.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                        eos_token_id=list(model.tokenizer.eos_ids), pad_token_id=2)
    want = hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    print(f"{problem['task_id']}: {len(out[0]) - ids.shape[1]} tokens, kvjax == "
          f"transformers: {reply == want}")
    assert reply == want
