"""Study A's own Table 1 beside a run's (issue 52): the study's published figures and setup as data, and the run's
setup in the same rows, so that a reader sees which GPUs, model, documents and pool each number comes from before
comparing any two. The study published no intervals; its figures rest on its 64 follow-ups a side."""

from __future__ import annotations

from dataclasses import astuple, dataclass

import pandas as pd

from kvpool.cells import Cell
from kvpool.engine.model import engine_pool_bytes_per_token
from kvpool.report.format import markdown_table, table1_arm, table1_ratio
from kvpool.report.lede import engine_words, hardware_words, model_words


@dataclass(frozen=True)
class Setup:
    """What a Table 1 was measured on, a phrase a row (``ROWS`` names them in order)."""

    gpus: str
    replicas: str
    model: str
    engine: str
    documents: str
    pool: str
    followups: str


ROWS = ("GPUs", "Replicas", "Model", "Engine", "Documents", "Pool", "Follow-ups")


@dataclass(frozen=True)
class Published:
    """A study's Table 1 as published: its setup and, per kvpool Table 1 metric, the isolated figure, the shared one
    and the study's own ratio ("n/a" where it gave none), each as printed."""

    name: str
    setup: Setup
    figures: dict[str, tuple[str, str, str]]


STUDY_A = Published(
    name="Study A",
    setup=Setup(
        gpus="4 x NVIDIA RTX PRO 6000 Blackwell Server Edition (96 GB each)",
        replicas="4, one a GPU, tensor parallel 1",
        model="Qwen3-Coder-30B-A3B-Instruct-FP8, its trained weights",
        engine="vLLM 0.26 with LMCache 0.5.3",
        documents="64 of about 99K tokens (a pool of about 620 GB)",
        pool="LMCache's local_disk on a Solidigm D7-PS1010 (TLC), the page cache dropped between steps",
        followups="64, each to a replica that did not prefill its document, one at a time"),
    figures={"ttft_p50_s": ("18.38 s", "2.20 s", "8.4x"), "ttft_p95_s": ("19.5 s", "3.7 s", "5.3x"),
             "ttft_p99_s": ("19.6 s", "3.8 s", "5.2x"), "reload_rate": ("0%", "89%", "n/a"),
             "slo_attainment": ("0%", "100%", "n/a"), "wall_clock_s": ("338 s", "38 s", "8.8x"),
             "mean_power_w": ("413 W", "119 W", "3.5x"), "errors": ("0", "0", "n/a")})


def run_setup(config: dict, cells: list[Cell], manifests: list[dict]) -> Setup:
    """This run's setup in :class:`Setup`'s rows, from its config and its cells' manifests (hardware, versions)."""
    hardware = dict.fromkeys(hardware_words(manifest.get("hardware", {})) for manifest in manifests)
    engines = dict.fromkeys(engine_words(config, manifest.get("versions", {})) for manifest in manifests)
    engine, spec = config["engine"], config.get("random_model") or {}
    replicas, per_gpu = config["replicas"], engine.get("replicas_per_gpu", 1)
    packed = "" if per_gpu == 1 else ", packed on one GPU" if per_gpu >= replicas else f", {per_gpu} a GPU"
    model = model_words(config)
    if spec and spec.get("weights") == "drawn":
        model += ", weights drawn by each replica's vLLM"
    if engine.get("quantization"):
        model += f", {engine['quantization'].upper()} weights"
    workload = config["workload"]
    followups = workload["documents"] * workload.get("followups_per_document", 1)
    per_token = engine_pool_bytes_per_token(config)
    pool_gb = workload["documents"] * workload["doc_tokens"] * per_token / 1e9 if per_token else None
    pool = f" (a pool of {pool_gb:.3g} GB)" if pool_gb else ""
    return Setup(
        gpus="; ".join(hardware) or "not recorded",
        replicas=f"{replicas}{packed}",
        model=model,
        engine="; ".join(engines),
        documents=f"{workload['documents']} of {workload['doc_tokens']:,} tokens{pool}",
        pool="; ".join(dict.fromkeys(f"{cell.backend} on {cell.tier}" for cell in cells)),
        followups=f"{followups} a cell, each to a replica that did not prefill its document, one at a time")


def beside(table: pd.DataFrame, setup: Setup, study: Published = STUDY_A) -> str:
    """The Markdown section that sets ``study``'s Table 1 beside this run's (``table``: Table 1's long form), metric
    by metric, under both setups."""
    setups = markdown_table(["", study.name, "This run"], zip(ROWS, astuple(study.setup), astuple(setup), strict=True))
    rows = []
    for metric, printed in study.figures.items():
        rows.append([metric, study.name, *printed])
        for _, row in table[table["metric"] == metric].iterrows():
            rows.append([metric, f"{row['backend']}, chunk {row['chunk']}, {row['tier']}", table1_arm(row, "isolated"),
                         table1_arm(row, "shared"), table1_ratio(row)])
    figures = markdown_table(["Metric", "Measured by", "Isolated", "Shared", "Isolated / shared"], rows)
    note = (f"{study.name}'s figures are as published: no intervals, 64 follow-ups a side, on its setup above. Where "
            "the setups differ (GPUs, weights, documents, pool), compare the ratios, not the seconds or watts.")
    return "\n".join([f"## Beside {study.name} as published", "", *setups, "", *figures, "", note]) + "\n"
