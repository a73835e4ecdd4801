"""kvq.Model on the shared stories260K against the kvq CLI's --json output with the same options,
and the exceptions its bad arguments raise."""
import json
import subprocess

import pytest

kvq = pytest.importorskip("kvq", reason="the kvq module is not importable (pip install . or PYTHONPATH=build/python)")
from conftest import data_path, kvq_bin  # noqa: E402

THREADS = 2  # split-K chunks depend on the thread count: the same in both runs


def cli_json(*args):
    r = subprocess.run([kvq_bin(), *args, "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def model(stories260k):
    return kvq.Model(stories260k)


def golden_prompts():
    g = json.loads(data_path("golden/stories260K/generation.json").read_text())
    return sorted({run["prompt"] for run in g["runs"]})


# (Python keyword arguments, the CLI's flags): cache options spelled as the CLI's.
CONFIGS = [
    ({}, []),
    ({"type_k": "q4", "type_v": "q4"}, ["-ctk", "q4", "-ctv", "q4"]),
    ({"type_k": "kivi4", "type_v": "q4", "kivi_group": 16, "kivi_residual": 16},
     ["-ctk", "kivi4", "-ctv", "q4", "--kv-kivi-group", "16", "--kv-residual", "16"]),
    ({"type_k": "q8", "type_v": "q4", "rotation": "srht", "kv_seed": 7, "sink": 4, "recent": 8},
     ["-ctk", "q8", "-ctv", "q4", "--kv-rot", "srht", "--kv-seed", "7", "--kv-sink", "4", "--kv-exact-recent", "8"]),
    ({"type_k": "q3", "type_v": "q3", "k_channel_scale": "off", "rotation": "none"},
     ["-ctk", "q3", "-ctv", "q3", "--kv-k-channel-scale", "off", "--kv-rot", "none"]),
    ({"type_k": "q4", "type_v": "q4", "certify": True, "certify_tol": 0.05},
     ["-ctk", "q4", "-ctv", "q4", "--kv-certify", "--kv-tol", "0.05"]),
]


@pytest.mark.parametrize("kw,flags", CONFIGS, ids=lambda c: str(c))
def test_generate_equals_cli_ids(model, stories260k, kw, flags):
    for prompt in golden_prompts():
        py = model.generate(prompt, 48, n_ctx=256, n_threads=THREADS, details=True, **kw)
        cli = cli_json("generate", "-m", stories260k, "-p", prompt, "-n", "48", "-c", "256", "--temp", "0",
                       "-t", str(THREADS), *flags)
        assert py["prompt_ids"] == cli["prompt_ids"]
        assert py["ids"] == cli["ids"] and len(py["ids"]) > 0
        for key in ("text", "stop_reason", "kv_cache", "kv_type_k", "kv_type_v", "kv_bytes_per_token",
                    "kv_bytes_allocated", "kv_bytes_used"):
            assert py[key] == cli[key], key
        assert ("certified" in py) == ("certified" in cli) == bool(kw.get("certify"))
        if "certified" in py:
            assert py["certified"] == cli["certified"]
        assert model.generate(prompt, 48, n_ctx=256, n_threads=THREADS, **kw) == cli["text"]


def test_sampled_generate_equals_cli_with_the_same_seed(model, stories260k):
    prompt = "The little dog"
    py = model.generate(prompt, 40, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=1234, n_ctx=128,
                        n_threads=THREADS, details=True, type_k="q4", type_v="q8")
    cli = cli_json("generate", "-m", stories260k, "-p", prompt, "-n", "40", "-c", "128", "--temp", "0.8",
                   "--top-k", "20", "--top-p", "0.9", "--min-p", "0.02", "-s", "1234", "-t", str(THREADS),
                   "-ctk", "q4", "-ctv", "q8")
    assert py["ids"] == cli["ids"] and py["seed"] == cli["seed"] == 1234
    # any 64-bit seed, as the CLI and the server take it (both refused it above 2^32 - 1); a negative
    # seed is its two's complement
    for seed in (2**40 + 1234, -7):
        py = model.generate(prompt, 16, temperature=0.8, seed=seed, n_ctx=128, n_threads=THREADS, details=True)
        cli = cli_json("generate", "-m", stories260k, "-p", prompt, "-n", "16", "-c", "128", "--temp", "0.8",
                       "-s", str(seed), "-t", str(THREADS))
        assert py["seed"] == cli["seed"] == seed % 2**64
        assert py["ids"] == cli["ids"]


def test_stream_yields_the_generated_text(model):
    prompt = "Lily and Tom went to the park."
    pieces = list(model.stream(prompt, 40, type_k="q4", type_v="q4", n_threads=THREADS))
    assert len(pieces) > 5
    assert "".join(pieces) == model.generate(prompt, 40, type_k="q4", type_v="q4", n_threads=THREADS)
    it = model.stream(prompt, 1000, ignore_eos=True, n_ctx=1024)
    first = next(it)
    it.close()  # stops the generation; the model is free again
    assert first == pieces[0]
    assert model.generate(prompt, 3) == model.generate(prompt, 3)
    with pytest.raises(ValueError, match="unknown V cache type"):
        list(model.stream(prompt, 5, type_v="q5"))


def test_an_exception_in_on_token_stops_generation(model):
    seen = []

    def on_token(piece):
        seen.append(piece)
        if len(seen) == 3:
            raise RuntimeError("enough")

    with pytest.raises(RuntimeError, match="enough"):
        model.generate("Once upon a time", 50, on_token=on_token)
    assert len(seen) == 3
    assert model.generate("Once upon a time", 3, details=True)["n_generated"] == 3  # usable again


def test_tokenize_equals_cli(model, stories260k):
    text = "Once upon a time, <s> there was"
    for kw, flags in [({}, []), ({"add_bos": False}, ["--no-bos"]), ({"parse_special": False}, ["--no-parse-special"])]:
        r = subprocess.run([kvq_bin(), "tokenize", "-m", stories260k, "-p", text, *flags], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert model.tokenize(text, **kw) == json.loads(r.stdout)
    ids = model.tokenize("The little dog", add_bos=False)
    assert model.detokenize(ids) == " The little dog"  # SentencePiece's dummy leading space


@pytest.mark.parametrize("kw,flags", [
    ({}, []),
    ({"type_k": "q4", "type_v": "q4", "compare": "f16"}, ["-ctk", "q4", "-ctv", "q4", "--compare", "f16"]),
])
def test_perplexity_equals_cli(model, stories260k, tmp_path, kw, flags):
    text = data_path("data/tinystories-valid-1000/tinystories_val.txt").read_text(encoding="utf-8")[:20000]
    f = tmp_path / "text.txt"  # the CLI reads a file: the same prefix
    f.write_text(text, encoding="utf-8")
    py = model.perplexity(text, 128, 6, n_threads=THREADS, **kw)
    cli = cli_json("perplexity", "-m", stories260k, "-f", str(f), "-c", "128", "--chunks", "6", "-t", str(THREADS),
                   "--no-progress", *flags)
    assert py["n_chunk"] == 6 and py["n_scored"] == 6 * 63
    for key in ("n_ctx", "n_tokens", "n_chunk", "n_scored", "n_scored_per_chunk", "ppl", "ppl_err", "nll_mean",
                "ppl_running_per_chunk", "kv_cache", "kv_bytes_per_token", "kv_bytes_per_token_f16"):
        assert py[key] == cli[key], key
    # llama.cpp's [1] .. [n] running PPL: one per chunk, the last the final estimate
    assert len(cli["ppl_running_per_chunk"]) == 6
    assert cli["ppl_running_per_chunk"][-1] == pytest.approx(cli["ppl"], rel=1e-12)
    assert ("kld" in py) == ("kld" in cli) == ("compare" in kw)
    if "kld" in py:
        for key in ("mean", "mean_err", "median", "p99", "max", "same_top1_pct", "ppl_base", "dppl_pct"):
            assert py["kld"][key] == cli["kld"][key], key


# --- errors -------------------------------------------------------------------------------------


def test_missing_file_raises_os_error(tmp_path):
    with pytest.raises(OSError, match=r"\[gguf\] .*nope.gguf: cannot open"):
        kvq.Model(str(tmp_path / "nope.gguf"))


def test_malformed_file_raises_value_error(tmp_path):
    p = tmp_path / "text.gguf"
    p.write_text("not a gguf file at all, just some text to fill the header")
    with pytest.raises(ValueError, match=r"^\[gguf\]"):
        kvq.Model(str(p))


def test_bad_arguments(model):
    with pytest.raises(ValueError, match=r"unknown K cache type 'q5'"):
        model.generate("Once", 4, type_k="q5")
    with pytest.raises(ValueError, match=r"\[generate\] -n -5 must be >= -1"):
        model.generate("Once", -5)
    with pytest.raises(ValueError, match=r"\[generate\] .*exceeds the model's training context"):
        model.generate("Once", 4, n_ctx=100000)
    with pytest.raises(TypeError, match="cache option sink must be an int, got str"):
        model.generate("Once", 4, sink="4")
    with pytest.raises(TypeError, match="unexpected keyword argument 'ctk'"):
        model.generate("Once", 4, ctk="q4")
    with pytest.raises(TypeError):
        model.generate(42, 4)
    with pytest.raises(ValueError, match=r"^\[perplexity\]"):
        model.perplexity("Once upon a time", 128)  # fewer tokens than one chunk
    with pytest.raises(TypeError, match="compare must be a cache type name"):
        model.perplexity("Once upon a time", 128, compare=16)
    with pytest.raises(ValueError):
        model.detokenize([1, 100000])
