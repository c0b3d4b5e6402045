"""The GPU projection: the roofline's physics, its published anchor points, the bound, and the command."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from coserve.bench.gpu_projection import ProjectionSettings, finetune_bound, project_scenario, served_inference_s
from coserve.bench.roofline import A100_80GB, H100_80GB, LLAMA_3_1_8B, LLAMA_3_2_1B, RooflineModel
from coserve.cli import build_parser
from coserve.planner.latency_features import PlanFeatures


def _decode(batch: int, context: int = 512, **finetune: float) -> PlanFeatures:
    return PlanFeatures(decode_tokens=batch, decode_context=batch * context, num_sequences=batch, **finetune)


@pytest.mark.parametrize("gpu", [A100_80GB, H100_80GB])
@pytest.mark.parametrize("model", [LLAMA_3_2_1B, LLAMA_3_1_8B])
def test_fine_tuning_rides_a_decode_batch_nearly_free_but_not_a_prefill(model, gpu) -> None:
    roofline = RooflineModel(model, gpu)
    window = PlanFeatures(ft_forward_tokens=64, ft_pieces=1)
    flops_s = roofline.compute_s(window)  # what the 64 rows cost at the reachable FLOP rate
    decode = _decode(8)
    on_decode = roofline.predict(decode + window) - roofline.predict(decode)
    assert on_decode <= roofline.fixed.per_piece + 1e-12  # memory-bound: only the piece's fixed cost
    prefill = PlanFeatures(prefill_tokens=2048, prefill_attention=2048 * 2049 / 2, prefill_chunks=1, num_sequences=1)
    on_prefill = roofline.predict(prefill + window) - roofline.predict(prefill)
    assert on_prefill == pytest.approx(flops_s + roofline.fixed.per_piece, rel=1e-6)  # compute-bound: full price
    # Well past the ridge a decode batch is compute-bound too: fine-tuning rows then cost their FLOPs.
    big = _decode(int(3 * roofline.ridge_rows()), context=16)
    assert roofline.predict(big + window) - roofline.predict(big) == pytest.approx(flops_s + roofline.fixed.per_piece)


def test_roofline_reproduces_the_published_batch_one_decode_steps() -> None:
    # Llama-3.1-8B, vLLM, batch 1 (roofline's docstring): 6.48 ms on an H100-80GB (short chats), ~13.3 ms
    # on an A100-40GB (1,555 GB/s; 1024-token prompts).
    h100 = RooflineModel(LLAMA_3_1_8B, H100_80GB).predict(_decode(1, context=200))
    a100_40 = RooflineModel(LLAMA_3_1_8B, dataclasses.replace(A100_80GB, memory_bandwidth=1.555e12))
    assert h100 == pytest.approx(6.48e-3, rel=0.10)  # a roofline against a published measurement: 10%
    assert a100_40.predict(_decode(1, context=1100)) == pytest.approx(13.3e-3, rel=0.10)


def test_backward_runs_after_the_forward_and_pays_its_flops() -> None:
    roofline = RooflineModel(LLAMA_3_1_8B, A100_80GB)
    decode, backward = _decode(8), PlanFeatures(ft_backward_token_layers=4096, ft_pieces=2)
    added = roofline.predict(decode + backward) - roofline.predict(decode)
    assert added >= roofline.compute_s(backward)  # no overlap with the decode's weight read


def test_bound_is_the_flops_left_over() -> None:
    assert finetune_bound(1000.0, 15.0, 60.0) == pytest.approx(750.0)
    assert finetune_bound(1000.0, 90.0, 60.0) == 0.0


def test_bound_charges_the_inference_of_runs_that_kept_the_slo() -> None:
    rows = [{"slo_attainment": 1.0, "inference_compute_s": 20.0}, {"slo_attainment": 0.95, "inference_compute_s": 18.0},
            {"slo_attainment": 0.2, "inference_compute_s": 5.0}]  # missed the SLO: served a fraction
    assert served_inference_s(rows) == 18.0
    assert served_inference_s(rows[2:]) == 5.0  # none kept it: the least of all


def test_no_policy_trains_past_the_bound_and_coserve_beats_temporal_sharing() -> None:
    settings = ProjectionSettings(window_s=4.0, policies=("coserve-strict", "temporal-n16"),
                                  finetune_tokens=(256, 1024))
    result = project_scenario("1b", "a100", [10.0], settings)
    (summary,) = result["rates"]
    for row in result["runs"]:
        assert row["slo_attainment"] >= 0.9
        assert 0 < row["finetune_tokens_per_s"] <= summary["bound_tokens_per_s"]
        assert 0 < row["window_split"]["compute"] <= 1.0 + 1e-9
    assert result["finetune_alone_tokens_per_s"] <= result["finetune_compute_tokens_per_s"]
    assert summary["best_baseline"] == "temporal-n16"
    assert summary["coserve-strict"]["vs_best_baseline"] > 1.0


def test_command_writes_json_and_markdown(tmp_path: Path, capsys) -> None:
    out = tmp_path / "gpu.json"
    args = build_parser().parse_args(["bench", "gpu-projection", "--models", "8b", "--gpus", "h100", "--rates", "2",
                                      "--policies", "coserve,temporal-n4", "--window-s", "3", "--json", str(out)])
    assert args.handler(args) == 0
    result = json.loads(out.read_text())
    (scenario,) = result["scenarios"]
    assert scenario["model"] == "Llama-3.1-8B" and scenario["gpu"] == "H100-80GB-SXM"
    assert {r["policy"] for r in scenario["runs"]} == {"coserve", "temporal-n4"}
    assert "gpu-projection" in result["meta"]["command"]
    assert "### Llama-3.1-8B on one H100-80GB-SXM" in capsys.readouterr().out


def test_command_refuses_an_unknown_model_before_running(capsys) -> None:
    args = build_parser().parse_args(["bench", "gpu-projection", "--models", "70b"])
    assert args.handler(args) == 2
    assert "unknown model" in capsys.readouterr().err
