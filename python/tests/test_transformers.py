"""veloq.transformers on CPU with the real SmolLM2, loaded by transformers from the GGUF file
scripts/fetch-data brings: greedy tokens against DynamicCache, logits within the codec's error,
resident bytes measured from what each cache holds, and the needle through this path. Skipped
where torch and transformers are not installed (they are in CI: .ci/run)."""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import veloq  # noqa: E402
import veloq.transformers as vt  # noqa: E402
from conftest import CACHE, MODEL, TEXT  # noqa: E402


@pytest.fixture(scope="module")
def hf():
    tok = transformers.AutoTokenizer.from_pretrained(CACHE, gguf_file=MODEL.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(CACHE, gguf_file=MODEL.name, attn_implementation="veloq")
    model.eval()
    return model, tok


@pytest.fixture(scope="module")
def hf_cal(hf, tmp_path_factory):
    model, tok = hf
    out = tmp_path_factory.mktemp("hfcal") / "smollm2-hf.vq-4.safetensors"
    stages = []
    cal = vt.calibrate(model, tok, TEXT, tokens=2048, out=out, progress=lambda *a: stages.append(a))
    assert out.exists() and veloq.Calibration.load(out).layers == 30
    assert stages[0] == ("collecting", 2048, 2048) and stages[-1] == ("training", 30, 30)
    return cal


def prompt_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


def test_geometry_is_read_from_the_config(hf):
    g = vt.geometry(hf[0])
    assert (g["layers"], g["q_heads"], g["kv_heads"], g["head_dim"]) == (30, 9, 3, 64)
    assert g["windows"] == [None] * 30


def test_fp16_through_veloq_equals_dynamic_cache(hf):
    # fp16 rows are exact up to f16 rounding of keys and values: the same greedy tokens.
    model, tok = hf
    ids = prompt_ids(tok, "What is the capital of France?")
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, cache=transformers.DynamicCache())
    for threads in (None, 2):  # veloq's kernels on one thread of their own (the default), or two
        cache = vt.VeloqCache(model, method="fp16", threads=threads)
        got = model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache)
        assert torch.equal(ref, got)


def test_a_left_padded_batch_generates_as_dynamic_cache_does(hf, hf_cal):
    """Prompts of different lengths in one batch, left-padded: veloq holds no pad (each sequence
    from its own length on, decoded as a ragged batch) and gives DynamicCache's tokens with fp16
    rows; with vq-4 each sequence keeps its own length in codes and the output stays on topic."""
    model, tok = hf
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "left"
    chats = [[{"role": "user", "content": c}] for c in ("What is the capital of France?", "Name three colours of the rainbow, please.", "Hi")]
    batch = tok.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", return_dict=True, padding=True)
    pads = (batch["attention_mask"] == 0).sum(-1).tolist()
    assert len(set(pads)) == 3, "three different lengths"
    ref = model.generate(**batch, max_new_tokens=12, do_sample=False, cache=transformers.DynamicCache())
    cache = vt.VeloqCache(model, method="fp16")
    got = model.generate(**batch, max_new_tokens=12, do_sample=False, cache=cache)
    assert torch.equal(ref, got)
    width = batch["input_ids"].shape[1]
    held = [cache.native.length(0, s) for s in range(3)]
    assert held == [width + 11 - p for p in pads], "no pad held, each sequence at its own length"
    coded = vt.VeloqCache(model, hf_cal)
    out = model.generate(**batch, max_new_tokens=12, do_sample=False, cache=coded)
    assert [coded.native.length(0, s) for s in range(3)] == held
    assert "Paris" in tok.decode(out[0, width:])


def test_crop_takes_positions_back_and_assisted_decoding_runs(hf, hf_cal):
    """`crop` (speculative decoding's rollback) takes a cache back to where it was: steps fed again
    give the same logits (exactly with fp16 rows; with vq-4, within the codec's error, the codes
    cut back into the recent window decoded); and transformers' assisted generation, which crops
    after every verification, writes the target's own greedy tokens."""
    model, tok = hf
    # Past the recent window: with vq-4 the cut reaches positions already coded.
    ids = prompt_ids(tok, TEXT.read_text()[20_000:22_500] + "\n\nWrite two sentences about the sea.")
    assert ids.shape[1] > 400
    steps = torch.tensor([[tok.encode(w)[0]] for w in (" The", " sea", " is", " wide", " and", " blue")])
    for cache, exact in ((vt.VeloqCache(model, method="fp16"), True), (vt.VeloqCache(model, hf_cal), False)):
        with torch.no_grad():
            model(ids, cache=cache)
            first = [model(x[None], cache=cache).logits[0, -1] for x in steps]
            assert cache.get_seq_length() == ids.shape[1] + 6
            cache.crop(-4)
            assert cache.get_seq_length() == ids.shape[1] + 2
            again = [model(x[None], cache=cache).logits[0, -1] for x in steps[2:]]
        for a, b in zip(first[2:], again):
            if exact:
                assert torch.equal(a, b)
            else:
                p, q = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
                assert float((p.exp() * (p - q)).sum()) < 0.05
    ids = prompt_ids(tok, "Write two sentences about the sea.")
    ref = model.generate(ids, max_new_tokens=24, do_sample=False, cache=transformers.DynamicCache())
    got = model.generate(ids, max_new_tokens=24, do_sample=False, cache=vt.VeloqCache(model, method="fp16"), assistant_model=model)
    assert torch.equal(ref, got)


def test_vq4_tracks_dynamic_cache_in_less_memory(hf, hf_cal):
    model, tok = hf
    text = TEXT.read_text()[200_000:206_000]
    ids = tok(text, return_tensors="pt").input_ids[:, :1024]
    with torch.no_grad():
        dyn = transformers.DynamicCache()
        ref = model(ids, cache=dyn).logits[0, -1]
        cache = vt.VeloqCache(model, hf_cal, max_context=2048)
        model(ids[:, :-1], cache=cache)  # the prefix leaves the window: codes
        got = model(ids[:, -1:], cache=cache).logits[0, -1]
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = float((p.exp() * (p - q)).sum())
    # The codec's error, measured against fp16 on this text by `veloq-lab eval` (vq-4 KL ~0.01 per
    # token at ctx 512–2048), bounds the next-token distribution's distance; a broken path is
    # orders of magnitude off (random keys give KL > 1).
    assert kl < 0.1, kl
    assert cache.get_seq_length() == 1024
    assert vt.kv_bytes(dyn) == 1024 * 30 * 3 * 64 * 2 * 4  # float32 keys and values
    fp16_bytes = 1024 * 30 * 3 * 64 * 2 * 2
    assert vt.kv_bytes(cache) < fp16_bytes / 3, (vt.kv_bytes(cache), fp16_bytes)


def test_vq4_chooses_dynamic_caches_tokens_wherever_the_choice_is_clear(hf, hf_cal):
    # Teacher-forced over DynamicCache's greedy continuation: each step attends over the earlier
    # positions as codes, and must pick the reference's token wherever the reference's top two
    # logits are 0.5 apart (far beyond vq-4's logit error; closer calls may go either way, and a
    # free-running comparison would end at the first of them).
    model, tok = hf
    ids = prompt_ids(tok, "List the days of the week.")
    n = ids.shape[1]
    ref = model.generate(ids, max_new_tokens=16, do_sample=False, cache=transformers.DynamicCache(),
                         output_scores=True, return_dict_in_generate=True)
    seq = ref.sequences
    cache = vt.VeloqCache(model, hf_cal)
    compared = 0
    with torch.no_grad():
        logits = model(seq[:, :n], cache=cache).logits[0, -1]
        for i, scores in enumerate(ref.scores):
            top = scores[0].topk(2).values
            if float(top[0] - top[1]) > 0.5:
                assert int(logits.argmax()) == int(seq[0, n + i]), (i, tok.decode(seq[0, n:]))
                compared += 1
            logits = model(seq[:, n + i : n + i + 1], cache=cache).logits[0, -1]
    assert compared >= 8, compared


# The needle harness's prompt and scoring (crates/veloq-lab/src/needle.rs): the filler haystack,
# the key said twice, the chat question, and the answer's first run of digits, exactly.
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\n\nWhat is the pass key in the text above? Answer with the number only."


def needle_prompt(tok, key, depth, words=700):
    hay = (FILLER * (words // len(FILLER.split()) + 1)).split()[:words]
    at = round(depth * len(hay))
    text = " ".join(hay[:at]) + f" The pass key is {key}. Remember it. {key} is the pass key. " + " ".join(hay[at:])
    return prompt_ids(tok, text + QUESTION)


def correct(answer, key):
    """The answer's first run of digits is the key, exactly."""
    m = re.search(r"\d+", answer)
    return m is not None and m.group(0) == str(key)


def test_the_needle_is_found_through_this_path(hf, hf_cal):
    model, tok = hf
    cases = [(61750, 0.2), (48213, 0.5), (90357, 0.8)]
    answers = {"dynamic": [], "veloq": []}
    for key, depth in cases:
        ids = needle_prompt(tok, key, depth)
        assert 900 < ids.shape[1] < 1200
        for label, cache in [("dynamic", transformers.DynamicCache()), ("veloq", vt.VeloqCache(model, hf_cal, max_context=2048))]:
            out = model.generate(ids, max_new_tokens=16, do_sample=False, cache=cache)
            answers[label].append(correct(tok.decode(out[0, ids.shape[1] :]), key))
    # 4-bit codes retrieve as fp16 does (the README's needle grid): the same prompts answered.
    assert answers["dynamic"] == [True] * 3, answers
    assert answers["veloq"] == answers["dynamic"], answers


def test_misuse_is_refused(hf, hf_cal):
    model, tok = hf
    with pytest.raises(veloq.CalibrationError, match="needs a calibration"):
        vt.VeloqCache(model, method="vq-4")
    with pytest.raises(veloq.ConfigError, match="at least 1"):
        vt.VeloqCache(model, method="fp16", threads=0)
    # A calibration of another geometry (head_dim 32) is refused before any work.
    rng = np.random.default_rng(0)
    small = [rng.standard_normal((512, 3, 32)).astype(np.float32) for _ in range(30)]
    with pytest.raises(veloq.CalibrationError, match="head_dim"):
        vt.VeloqCache(model, veloq.Calibration.train(small, small, method="vq-4"))
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.padding_side = "right"
    ids = tok(["a b c", "a"], return_tensors="pt", padding=True)
    with pytest.raises(NotImplementedError, match="left-padded"):
        model(**ids, cache=vt.VeloqCache(model, method="fp16"))
    tok.padding_side = "left"
    # Without a VeloqCache the veloq attention runs SDPA: the same logits as a plain model.
    x = tok("Hello there", return_tensors="pt").input_ids
    with torch.no_grad():
        a = model(x, use_cache=False).logits
        b = model(x, cache=transformers.DynamicCache()).logits
    assert torch.allclose(a, b, atol=1e-4)


GEMMA = CACHE / "gemma-3-270m-q4_k_m.gguf"


@pytest.fixture(scope="module")
def gemma():
    if not GEMMA.exists():
        pytest.fail(f"{GEMMA} missing: run scripts/fetch-data")
    tok = transformers.AutoTokenizer.from_pretrained(CACHE, gguf_file=GEMMA.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(CACHE, gguf_file=GEMMA.name, attn_implementation="veloq")
    return model.eval(), tok


def test_gemma3_sliding_windows_head_dim_256_and_gqa(gemma):
    model, tok = gemma
    g = vt.geometry(model)
    assert (g["head_dim"], g["q_heads"], g["kv_heads"]) == (256, 4, 1)
    assert g["windows"].count(None) == 3 and set(g["windows"]) == {512, None}
    # 900 positions: past the 512-position window of the sliding layers.
    ids = tok(TEXT.read_text()[300_000:306_000], return_tensors="pt").input_ids[:, :900]
    with torch.no_grad():
        ref = model(ids, cache=transformers.DynamicCache()).logits[0, -1]
        fp16 = vt.VeloqCache(model, method="fp16", max_context=1024)
        model(ids[:, :-1], cache=fp16)
        got = model(ids[:, -1:], cache=fp16).logits[0, -1]
        # f16 keys and values against float32 ones: the logits move by f16 rounding alone.
        assert (ref - got).abs().max() < 0.1, float((ref - got).abs().max())
        cal = vt.calibrate(model, tok, TEXT, tokens=1024)
        coded = vt.VeloqCache(model, cal, max_context=1024)
        model(ids[:, :-1], cache=coded)
        q = torch.log_softmax(model(ids[:, -1:], cache=coded).logits[0, -1], -1)
    p = torch.log_softmax(ref, -1)
    kl = float((p.exp() * (p - q)).sum())
    assert kl < 0.1, kl
    assert coded.get_seq_length() == 900 and fp16.resident_bytes > coded.resident_bytes
    # A left-padded batch: 600 positions (past the window) beside 100 behind 500 pads, which the
    # sliding layers' windows span in transformers' positions. veloq holds no pad; the next step's
    # logits are DynamicCache's within f16 rounding for both.
    ids = torch.cat([ids[:, :600], torch.cat([torch.zeros(1, 500, dtype=ids.dtype), ids[:, 700:800]], 1)])
    mask = torch.ones_like(ids)
    mask[1, :500] = 0
    step = {"input_ids": ids[:, -1:] * 0 + 2, "attention_mask": torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)}
    with torch.no_grad():
        dyn, fp16 = transformers.DynamicCache(), vt.VeloqCache(model, method="fp16", max_context=1024)
        for cache in (dyn, fp16):
            model(input_ids=ids, attention_mask=mask, cache=cache)
        ref, got = (model(**step, cache=c).logits[:, -1] for c in (dyn, fp16))
    assert (ref - got).abs().max() < 0.1, float((ref - got).abs().max())
    assert [fp16.native.length(0, s) for s in (0, 1)] == [601, 101] and fp16.get_seq_length() == 601
