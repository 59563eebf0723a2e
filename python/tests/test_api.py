"""The binding's front door on the real model: opening, generating (whole and streamed), chat,
the typed exceptions, and the server driven by the official OpenAI client."""

import pytest

import veloq


def test_methods_share_the_cli_vocabulary():
    names = dict(veloq.methods())
    assert {"fp16", "vq-4", "vq-2"} <= names.keys()
    assert "4.00 bits" in names["vq-4"], names["vq-4"]


def test_bad_input_raises_the_matching_exception(model_path, tmp_path):
    with pytest.raises(veloq.MethodError, match="17 bits"):
        veloq.Model.open(model_path, method="vq-17")
    with pytest.raises(veloq.DeviceError):
        veloq.Model.open(model_path, method="fp16", device="gpu")
    with pytest.raises(veloq.DeviceError, match="without CUDA"):
        veloq.Model.open(model_path, method="fp16", device="cuda")
    with pytest.raises(veloq.ModelError):
        veloq.Model.open(tmp_path / "missing.gguf", method="fp16")
    with pytest.raises(veloq.CalibrationError, match="veloq.calibrate"):
        veloq.Model.open(model_path, method="vq-2", calibration=tmp_path / "none.safetensors")
    with pytest.raises(veloq.ConfigError):
        veloq.Model.open(model_path, method="fp16", kernels="sometimes")
    with pytest.raises(veloq.ConfigError, match="stored .*f16 or f32"):
        veloq.Model.open(model_path, method="fp16", weights="q4")
    with pytest.raises(veloq.CalibrationError, match="takes no calibration"):
        veloq.Model.open(model_path, method="fp16", calibration=tmp_path / "any.safetensors")
    with pytest.raises(veloq.MethodError, match="no calibration"):
        veloq.calibrate(model_path, "some text", method="fp16")
    with pytest.raises(veloq.ConfigError, match="tokens"):
        veloq.calibrate(model_path, "far too short a text", tokens=512, out=tmp_path / "x.safetensors")
    with pytest.raises(veloq.ConfigError, match="uniform or attention"):
        veloq.calibrate(model_path, "some text", value_weights="loud")
    with pytest.raises(veloq.ConfigError, match="tokens"):
        veloq.calibrate(model_path, "far too short", tokens=512, value_weights="attention", out=tmp_path / "y.safetensors")
    assert issubclass(veloq.ContextOverflowError, veloq.VeloqError)


def test_generate_whole_and_streamed_agree(model):
    prompt = "Name three colours."
    whole = model.generate(prompt, max_tokens=24)
    stream = model.generate(prompt, max_tokens=24, stream=True)
    pieces = list(stream)
    assert len(pieces) > 1, "a stream yields pieces as they come"
    assert "".join(pieces) == whole == stream.result.text
    r = stream.result
    assert r.finish_reason in ("stop", "length") and 0 < len(r.tokens) <= 24
    # The chat template wraps the prompt.
    assert r.prompt_tokens > len(model.tokenize(prompt))
    assert 0 < r.kv_resident_bytes and r.kv_fp16_bytes > 0


def test_a_stream_stopped_early_leaves_the_model_usable(model):
    g = model.generate("Tell me a long story about a lighthouse.", max_tokens=200, stream=True)
    first = next(g)
    assert first and g.result is None and len(g.tokens) >= 1
    del g
    assert model.generate("Say hello.", max_tokens=4)


def test_sampling_is_seeded_and_checked(model):
    a = model.generate("Write a word.", max_tokens=8, temperature=1.0, seed=7)
    b = model.generate("Write a word.", max_tokens=8, temperature=1.0, seed=7)
    assert a == b
    for bad in ({"temperature": -1.0}, {"top_p": 7.0}, {"max_tokens": 0}, {"top_k": 0}, {"presence_penalty": 3.0}):
        with pytest.raises(veloq.ConfigError):
            model.generate("x", **bad)
    with pytest.raises(TypeError, match="max_token"):
        model.generate("x", max_token=4)  # a typo is an error, never ignored
    with pytest.raises(TypeError, match="temperature"):
        model.generate("x", temperature="hot")


def test_a_prompt_past_the_context_is_refused(model_path, calibration_path):
    small = veloq.Model.open(model_path, calibration=calibration_path, max_context=32)
    with pytest.raises(veloq.ContextOverflowError):
        small.generate("word " * 64, max_tokens=4)


def test_chat_keeps_the_conversation_in_the_cache(model):
    chat = model.chat()
    seen = []
    first = chat.say("My name is Ann.", max_tokens=16, on_text=seen.append)
    assert "".join(seen) == first.text and first.tokens
    n1 = len(chat.history)
    second = chat.say("What is my name?", max_tokens=16)
    # The second turn feeds only its own tokens: its prompt is the new turn, not the history.
    assert second.prompt_tokens < n1
    assert len(chat.history) > n1 + len(second.tokens) - 1
    assert chat.kv_resident_bytes > 0
    chat.reset()
    assert chat.history == []
    # A callback that raises stops the turn with its own exception.
    with pytest.raises(ZeroDivisionError):
        chat.say("Hi.", max_tokens=4, on_text=lambda s: 1 / 0)


def test_info_names_the_geometry_and_the_rate(model):
    info = model.info()
    assert (info["layers"], info["kv_heads"], info["head_dim"], info["heads"]) == (30, 3, 64, 9)
    assert info["method"] == "vq-4" and 4.0 < info["bits_per_element"] < 4.5
    assert model.detokenize(model.tokenize("Persuasion, by Jane Austen")) == "Persuasion, by Jane Austen"


def test_the_server_answers_the_openai_client_as_generate_does(model):
    openai = pytest.importorskip("openai")
    with veloq.serve(model, port=0, kv_budget="64MiB") as server:
        assert server.running and server.url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        reply = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=24,
            temperature=0,
        )
        assert reply.choices[0].message.content == model.generate("Name three colours.", max_tokens=24)
    assert not server.running
    with pytest.raises(veloq.ConfigError):
        veloq.serve(model, port=0, kv_budget="lots")
    with pytest.raises(veloq.ConfigError, match="auto, worst-case or grow"):
        veloq.serve(model, port=0, reserve="sometimes")
    with veloq.serve(model, port=0, kv_budget="64MiB", reserve="worst-case", prefix_cache=False) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        again = client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24, temperature=0
        )
        assert again.choices[0].message.content == reply.choices[0].message.content
