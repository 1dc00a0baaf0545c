"""bench_lowlat_tp.py's CPU-runnable parts: settings, per-rank bytes (against lmserver's own shards), target ratios,
the dry run, and (slow) a real run of the generic settings on the CPU at the tiny shape (TP 1 and TP 2 over gloo)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lowlat_tp as B  # noqa: E402


def test_settings_parse_and_bad_ones_are_named() -> None:
    assert B.parse_settings("1:nvidia, 2:off,2:require:nvidia") == [
        B.Setting(1, "nvidia"), B.Setting(2, "off"), B.Setting(2, "nvidia")]
    assert B.Setting(2, "nvidia").lowlat_plugins == "require:nvidia" and B.Setting(2, "off").lowlat_plugins == "off"
    for bad in ("3:nvidia", "2", "x:off", "2:", ""):
        with pytest.raises(ValueError):
            B.parse_settings(bad)
    with pytest.raises(SystemExit):
        B.parse_args(["--settings", "3:off"])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_bytes_equal_the_parameters_of_lmservers_shard(tp: int) -> None:
    """Oracle: the parameters lmserver's sharded model holds on one rank (every decoder layer, the final norm and the
    LM head's vocabulary shard; the embedding is read a row per token, not counted)."""
    from lmserver.models.config import ModelConfig
    from lmserver.models.llama import LlamaForCausalLM
    from lmserver.runner.distributed import TPGroup, shard_model_

    cfg = dict(B.SHAPES["tiny"], vocab_size=1001)  # a vocabulary the ranks split unevenly (padded shards)
    config = ModelConfig.from_hf(cfg)
    model = shard_model_(copy.deepcopy(LlamaForCausalLM(config)), config, TPGroup(0, tp))
    n = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    assert B.rank_step_bytes(cfg, tp, bytes_per_param=1) == n
    assert B.floor_ms(B.SHAPES["llama3-8b"], 2) < B.floor_ms(B.SHAPES["llama3-8b"], 1)


def test_ratios_and_table() -> None:
    rows = [{"tp": 1, "plugin": "nvidia", "label": "nvidia TP1", "floor_ms": 4.0, "c1_step_ms": 4.0, "c1_tok_s_per_user": 250.0},
            {"tp": 2, "plugin": "off", "label": "generic TP2", "floor_ms": 2.0, "c1_step_ms": 3.0, "c1_tok_s_per_user": 340.0},
            {"tp": 2, "plugin": "nvidia", "label": "nvidia TP2", "floor_ms": 2.0, "c1_step_ms": 2.5,
             "c1_tok_s_per_user": 400.0, "plugin_steps": 64}]
    assert B.ratios(rows) == [("nvidia TP2 / generic TP2", 400.0 / 340.0, 1.2), ("nvidia TP2 / nvidia TP1", 1.6, 1.5)]
    text = B.table(rows, [1])
    assert "nvidia TP2 / nvidia TP1: 1.60x (target 1.5x, met)" in text and "1.18x (target 1.2x)\n" in text
    assert B.ratios(rows[:1]) == []  # nothing at TP > 1: no target answered


def test_dry_run_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    B.main(["--dry-run", "--settings", "1:nvidia,2:off,2:nvidia"])
    out = capsys.readouterr().out
    assert "--tp-size 2 --lowlat-plugins require:nvidia" in out and "--lowlat-plugins off" in out
    assert f"floor {B.floor_ms(B.SHAPES['llama3-8b'], 2):.2f} ms" in out


@pytest.mark.slow
def test_generic_settings_run_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole measurement loop at the tiny shape, float32 on the CPU: TP 1 and TP 2 (gloo) give the same tokens."""
    import json

    out = tmp_path / "tp.json"
    B.main(["--settings", "1:off,2:off", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prompt-len", "16",
            "--decode-tokens", "4", "--check-tokens", "6", "--kv-tokens", "2048", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["label"] for r in rows] == ["generic TP1", "generic TP2"]
    assert rows[1]["greedy_match"] == rows[0]["greedy_match"] == "12/12"
    assert all(r["c1_tok_s_per_user"] > 0 for r in rows)
    assert "generic TP2" in capsys.readouterr().out  # the table
