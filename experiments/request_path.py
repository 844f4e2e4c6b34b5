"""How many kvjax modules one request's path crosses (issue 51's goal: from the server's
handler to the device step and back, <= 12 module boundaries).

Serves a model in this process (kvjax.server.handle.serve_in_thread), sends one
completion so that every program it needs is compiled, then records, with a profile hook
in every thread, the kvjax module of each Python call made while a second, identical
request is served.  A boundary is a pair of different kvjax modules where one calls into
the other (third-party frames between them, such as FastAPI's or asyncio's, are looked
through); the device step itself is one call into compiled code, so the model's modules
run only when a program is traced.  Two counts: the distinct boundaries the request
crosses anywhere, and the most crossed by one call stack (the deepest chain of modules,
each thread's stack on its own).  Writes results/request_path.json.

  python experiments/request_path.py [--checkpoint smollm2-135m-instruct] [--max-tokens 8]
"""
import argparse
import collections
import json
import os
import sys
import threading
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
import common  # pylint: disable=g-import-not-at-top,wrong-import-position

GOAL = 12
_LOOK_BACK = 64  # frames searched for the kvjax caller of a call


class CallRecorder:
  """A profile hook: while `on`, each call into a kvjax module is recorded with the kvjax
  module that (through any third-party frames) made it."""

  def __init__(self):
    self.on = False
    self.modules = collections.Counter()  # module -> calls into it
    self.crossings = collections.Counter()  # (caller module, callee module) -> calls
    self.deepest: tuple = ()  # the longest chain of kvjax modules on one stack
    self._lock = threading.Lock()

  def __call__(self, frame, event, arg):  # pylint: disable=unused-argument
    if not self.on or event != "call":
      return
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("kvjax"):
      return
    caller, steps = frame.f_back, 0
    while caller is not None and steps < _LOOK_BACK:
      name = caller.f_globals.get("__name__", "")
      if name.startswith("kvjax"):
        break
      caller, steps = caller.f_back, steps + 1
    caller_module = caller.f_globals["__name__"] if caller is not None and steps < _LOOK_BACK \
        else None
    chain = _module_chain(frame)
    with self._lock:
      self.modules[module] += 1
      if caller_module is not None and caller_module != module:
        self.crossings[(caller_module, module)] += 1
      if len(chain) > len(self.deepest):
        self.deepest = chain


def _module_chain(frame) -> tuple:
  """The kvjax modules on `frame`'s stack, outermost first, repeats in a row merged."""
  chain = []
  while frame is not None:
    module = frame.f_globals.get("__name__", "")
    if module.startswith("kvjax") and (not chain or chain[-1] != module):
      chain.append(module)
    frame = frame.f_back
  return tuple(reversed(chain))


def post(url: str, body: dict) -> dict:
  request = urllib.request.Request(url, json.dumps(body).encode(),
                                   {"content-type": "application/json"})
  with urllib.request.urlopen(request, timeout=600) as response:
    return json.load(response)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--checkpoint", default=None,
                      help="model to serve (default: the built-in 2.9M default model)")
  parser.add_argument("--max-tokens", type=int, default=8,
                      help="tokens the request generates (default: 8)")
  parser.add_argument("--out", default="results", help="where the JSON goes (default: results)")
  args = parser.parse_args()

  recorder = CallRecorder()
  threading.setprofile(recorder)  # every thread the server starts from here on
  sys.setprofile(recorder)
  import kvjax  # pylint: disable=g-import-not-at-top
  from kvjax.server.handle import serve_in_thread  # pylint: disable=g-import-not-at-top

  model = kvjax.load_checkpoint(args.checkpoint) if args.checkpoint else \
      kvjax.load_checkpoint()
  config = kvjax.EngineConfig(max_num_seqs=4, page_size=16)
  with serve_in_thread(model, config, served_model_name="m") as handle:
    body = dict(model="m", prompt="def fibonacci(n):", max_tokens=args.max_tokens,
                temperature=0.0)
    post(handle.url + "/completions", body)  # compiles what the request needs
    recorder.on = True
    answer = post(handle.url + "/completions", body)
    recorder.on = False
  sys.setprofile(None)
  threading.setprofile(None)

  pairs = sorted(recorder.crossings.items(), key=lambda item: -item[1])
  results = dict(
      issue=51, goal=f"<= {GOAL} module boundaries from the handler to the step and back",
      model=model.config.name, max_tokens=args.max_tokens,
      tokens=answer["usage"]["completion_tokens"], device=common.describe_device(),
      modules=dict(recorder.modules.most_common()), boundaries=len(recorder.crossings),
      deepest_chain=list(recorder.deepest), deepest_boundaries=len(recorder.deepest) - 1,
      crossings=[dict(caller=a, callee=b, calls=n) for (a, b), n in pairs])
  print(f"issue 51 goal: <= {GOAL} module boundaries; ours: {len(recorder.deepest) - 1} on "
        f"the deepest stack, {len(recorder.crossings)} caller -> callee pairs in all, over "
        f"{len(recorder.modules)} kvjax modules")
  print("  deepest: " + " -> ".join(recorder.deepest))
  for (a, b), n in pairs:
    print(f"  {a} -> {b}: {n} calls")
  common.write_json(os.path.join(args.out, "request_path.json"), results)


if __name__ == "__main__":
  main()
