"""``python -m dsa_plugins warmup``: which kernels a model needs, and one compile through a worker."""

import importlib.util

import pytest

from dsa_plugins import warmup
from dsa_plugins.adapters.hf import tiny

HAS_TILELANG = importlib.util.find_spec("tilelang") is not None


def test_presets_list_what_they_need(capsys):
    assert warmup.main(["--list", "glm5"]) == 0
    labels = capsys.readouterr().out.splitlines()
    assert "attention forward 576/512" in labels and "indexer scores Hi32 Di128" in labels
    assert "attention backward H64 576/512 main" in labels and any(l.startswith("indexer loss") for l in labels)
    assert warmup.main(["--list", "--inference", "deepseek_v4"]) == 0
    labels = capsys.readouterr().out.splitlines()
    assert "attention forward 512/512 sink" in labels
    assert not any("backward" in l or "loss" in l for l in labels)


def test_the_longest_compiles_start_first(capsys):
    """The pool runs the jobs in list order: a long compile queued behind short ones would finish last
    (cold GLM-5 + V4 warmup on 16 cores: 79 s while the longest job took 53 s)."""
    assert warmup.main(["--list", "glm5", "deepseek_v4"]) == 0
    labels = capsys.readouterr().out.splitlines()
    by_label = {j.label: j for d in ("glm5", "deepseek_v4") for j in warmup.jobs_for(warmup.load_dims(d)[0])}
    seconds = [by_label[l].seconds for l in labels]
    assert seconds == sorted(seconds, reverse=True) and len(set(seconds)) > 2
    assert labels[0].startswith("attention forward") and labels[-1].endswith(("preprocess", "preprocess_det", "reduce"))


def test_without_a_model_every_shipped_configuration():
    from dsa_plugins.kernels import indexer, sparse_attention_bwd, sparse_attention_fwd

    jobs = warmup.jobs_for(None)
    assert sum(j.function == "build_fwd_kernel" for j in jobs) == len(sparse_attention_fwd.SHIPPED_CONFIGS) + len(
        sparse_attention_fwd.DECODE_CLUSTER_CONFIGS)  # prefill and whole decode rows; parts merged in a cluster
    assert sum(j.function == "build_bwd_program" for j in jobs) == sum(
        len(sparse_attention_bwd.bwd_program_names(c)) for c in sparse_attention_bwd.SHIPPED_CONFIGS)
    # the shipped shapes' deterministic mode ("contrib_i16") needs the reduce, not the fixed-point preprocess
    names = [j.args[1] for j in jobs if j.function == "build_bwd_program"]
    assert "reduce" in names and "preprocess_det" not in names
    assert sum(j.function == "build_indexer" for j in jobs) == len(indexer.SHIPPED_CONFIGS)
    assert len({j.label for j in jobs}) == len(jobs), "labels must tell the kernels apart"


def test_a_model_gets_the_decode_part_programs_its_heads_and_shards_take():
    """Generation steps cut into parts compile one program per part count; rows left whole (DeepSeek-V4's 128
    heads) run the prefill's program, so no program of their own is listed."""
    labels = [j.label for j in warmup.jobs_for(warmup.load_dims("deepseek_v4")[0])]
    forward = [label for label in labels if label.startswith("attention forward")]
    # 128 heads whole; the shards of 64 and 32 heads in 2 parts, 16 heads in 2 (k 1024: at most 2 CTAs a row)
    assert forward == ["attention forward 512/512 sink", "attention forward 512/512 sink decode, 2 parts"]
    labels = [j.label for j in warmup.jobs_for(warmup.load_dims("glm5")[0])]
    assert [label for label in labels if "decode" in label] == ["attention forward 576/512 decode, 2 parts"]


@pytest.mark.parametrize("model_type", [m for m in tiny.SPECS if tiny.available(m)])
def test_dims_from_every_supported_model_config(model_type, tmp_path, capsys):
    config = tiny.tiny_config(model_type)
    (dims,) = warmup.model_dims(config)  # one set of dims per model (dots3_note: its indexed layers)
    # the model's own attention says whether it has per-head sinks (a model type missing from warmup's list fails)
    assert dims.sink == any(name.endswith(".sinks") for name, _ in tiny.tiny_model(model_type).named_parameters())
    text = config.get_text_config()
    assert dims.index_heads == text.index_n_heads
    config.save_pretrained(tmp_path)
    assert warmup.main(["--list", str(tmp_path / "config.json")]) == 0
    out, err = capsys.readouterr()
    assert "indexer scores Hi" in out
    # the tiny dims (e.g. 40/32) are not a kernel configuration: said, and nothing compiled for them
    assert f"attention forward {dims.dim_qk}/{dims.dim_v}" in out or "runs on the torch reference" in err


def test_a_config_without_dsa_is_refused_with_a_message(tmp_path, capsys):
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, intermediate_size=64).save_pretrained(tmp_path)
    assert warmup.main(["--list", str(tmp_path)]) == 2
    assert "not a DSA model" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
def test_a_job_compiles_for_sm90a_in_a_worker_process():
    (job,) = [j for j in warmup.jobs_for(None) if j.function == "build_finish"]
    ((label, seconds, error),) = warmup.compile_jobs([job], workers=1, on_gpu=False)
    assert error is None and label == job.label and seconds > 0


@pytest.mark.skipif(not HAS_TILELANG, reason="TileLang is not installed")
def test_first_build_in_a_process_says_so_once(caplog):
    """Without warmup the first calls are not silent: one warning names what is being built and
    how to compile ahead (in-process build of a small program for sm_90a)."""
    import logging

    from dsa_plugins.common.settings import reset_warnings
    from dsa_plugins.kernels import CPU_COMPILE_TARGET, topk

    reset_warnings()
    topk._BUILT.clear()
    with caplog.at_level(logging.WARNING, logger="dsa_plugins"):
        topk.build_finish(target=dict(CPU_COMPILE_TARGET))
        topk._BUILT.clear()
        topk.build_finish(target=dict(CPU_COMPILE_TARGET))
    notes = [r.getMessage() for r in caplog.records if "building TileLang kernels" in r.getMessage()]
    assert len(notes) == 1 and "dsa_plugins warmup" in notes[0]


def test_fp8_index_adds_the_fp8_indexer_programs():
    """``--fp8-index`` (the opt-in fp8 index cache) adds the fp8 indexer's prefill and generation-step score
    programs of the model's index heads, and nothing else; without it no fp8 program is compiled."""
    dims = warmup.load_dims("glm5")[0]
    plain = [j.label for j in warmup.jobs_for(dims, training=False)]
    fp8 = [j.label for j in warmup.jobs_for(dims, training=False, fp8_index=True)]
    assert not any("fp8" in label for label in plain)
    assert sorted(set(fp8) - set(plain)) == ["indexer scores Hi32 Di128 fp8",
                                             "indexer scores Hi32 Di128 fp8, generation steps"]
    assert set(plain) <= set(fp8)
