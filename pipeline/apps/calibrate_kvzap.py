"""``jobs/calibrate_kvzap.py``: the learned one-pass scorer (KVzap) and its cross-layer shares for
one model, written as a safetensors file.

    python jobs/calibrate_kvzap.py --model smollm2 --output kvzap.safetensors [--lengths 512,1024,2048]

Documents are generated offline (:mod:`pipeline.eval.kvzap_data`); Ray actors (``--actors``, each
holding the model) compute KVzip+ targets per document (:func:`pipeline.eval.kvzap_calibration.
document_targets`); the driver fits one predictor per layer on the training documents, reports the
fit on the held-out ones, and writes the file ``--kvzap-model`` reads (:mod:`pipeline.engine.kvzap_file`).
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Literal

import ray
from pydantic import BaseModel, ConfigDict, Field

from pipeline.distributed.cluster import check_model_source, ensure_ray
from pipeline.distributed.rundir import JobConfigError
from pipeline.engine.config import ModelConfig
from pipeline.engine.kvzap_file import model_fingerprint, write_kvzap
from pipeline.engine.loading import load_model
from pipeline.eval.kvzap_calibration import DocumentTargets, document_targets, fit
from pipeline.eval.kvzap_data import calibration_documents
from pipeline.options import OptionParser, fail, first_paragraph


class KVzapCalibrationJob(BaseModel):
    """KVzap calibration"""

    model_config = ConfigDict(extra="forbid")

    output: str = Field(description="KVzap safetensors file to write")
    lengths: list[int] = Field([512, 1024, 2048, 4096], description="context lengths of the documents (tokens)")
    documents: list[int] = Field(
        [16, 16, 16, 8], description="documents per length (one number for all, or one per length)"
    )
    sample_tokens: int = Field(256, ge=8, description="entries sampled per document for fitting")
    validation: float = Field(0.25, gt=0.0, lt=1.0, description="fraction of the documents held out for the fit report")
    kind: Literal["linear", "mlp"] = Field("linear", description="predictor per layer: ridge regression or MLP")
    alpha: float = Field(1e-3, gt=0.0, description="ridge strength, relative to the mean feature variance")
    mlp_width: int = Field(512, ge=8, description="hidden width of the MLP predictor")
    mlp_epochs: int = Field(15, ge=1, description="training epochs of the MLP predictor")
    share_sizes: list[float] = Field(
        [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9], description="kept fractions at which the shares are calibrated"
    )
    shares_by_length: bool = Field(
        False,
        description="one shares table per calibration length, interpolated in log length (4K RULER: better at "
        "cache 0.1-0.2, worse at 0.4 with CriticalKV; docs/results/kvzap-calibration/README.md)",
    )
    shares_target: Literal["kvzip", "predicted"] = Field(
        "kvzip",
        description="what the shares copy: each head's count in KVzip's global top-k of the true scores, or the "
        "counts that keep the most true score when each head keeps its predicted top entries",
    )
    positions: bool = Field(
        False,
        description="predict from each entry's distance to the context's end and its length too (KVzip's scores "
        "fall with that distance): held-out R2 0.44 -> 0.70, RULER better at cache 0.1, worse at 0.4 "
        "(docs/results/kvzap-positions/README.md)",
    )
    seed: int = Field(0, description="seed of the documents and of the sampled entries")
    actors: int = Field(1, ge=1, description="Ray actors computing targets (each holds the model)")
    cpus_per_actor: float = Field(2.0, gt=0, description="CPUs per actor")
    gpus_per_actor: float = Field(0.0, ge=0, description="GPUs per actor")
    ray_address: str | None = Field(None, description="Ray cluster to join (default: $RAY_ADDRESS or a local Ray)")
    model: ModelConfig = Field(default_factory=ModelConfig)


class TargetWorker:
    """Ray actor body: one engine, KVzip+ targets per document."""

    def __init__(self, model: dict) -> None:
        from pipeline.engine.engine import Engine  # inside the actor: the model loads there

        # the targets record every layer's input over the whole context: one forward, not layer by layer
        config = ModelConfig.model_validate(model).model_copy(update={"layerwise_prefill": 0})
        self.engine = Engine(load_model(config))

    def targets(self, doc: dict, sample_tokens: int, share_sizes: list[float], seed: int) -> DocumentTargets:
        if doc.get("length") is None:  # a user's document: its length bucket, from this model's tokenizer
            doc = {**doc, "length": length_bucket(len(self.engine.tokenizer(doc["context"]).input_ids))}
        return document_targets(self.engine, doc, sample_tokens, share_sizes, seed)

    def fingerprint(self) -> dict:
        return model_fingerprint(self.engine.model)


def length_bucket(tokens: int) -> int:
    """The power of two nearest to a document's token count (at least 64): its calibration length."""
    return max(64, 2 ** round(math.log2(max(tokens, 1))))


def collect_targets(
    model: dict, docs: list[dict], actors: int, cpus: float, gpus: float, args: tuple, log
) -> tuple[list[DocumentTargets], dict]:
    """KVzip+ targets of ``docs`` on ``actors`` Ray actors (Ray already initialised) and the model's
    fingerprint; ``args``: (sample_tokens, share_sizes, seed)."""
    worker = ray.remote(num_cpus=cpus, num_gpus=gpus)(TargetWorker)
    pool_actors = [worker.remote(model) for _ in range(max(1, min(actors, len(docs))))]
    pool = ray.util.ActorPool(pool_actors)
    results = []
    for i, result in enumerate(pool.map(lambda a, d: a.targets.remote(d, *args), docs)):
        results.append(result)
        log(f"{i + 1}/{len(docs)} {result.doc_id}")
    return results, ray.get(pool_actors[0].fingerprint.remote())


def _per_length(config: KVzapCalibrationJob) -> list[int]:
    if len(config.documents) == 1:
        return config.documents * len(config.lengths)
    if len(config.documents) != len(config.lengths):
        fail(f"invalid --documents: give one number or one per length ({len(config.lengths)})")
    return config.documents


def _collect(config: KVzapCalibrationJob, docs: list[dict], log) -> list[DocumentTargets]:
    started_here, address = ensure_ray(config.ray_address)
    log(f"Ray: {address}; {config.actors} actor(s), {len(docs)} documents")
    try:
        args = (config.sample_tokens, config.share_sizes, config.seed)
        model = config.model.model_dump(mode="json")
        return collect_targets(model, docs, config.actors, config.cpus_per_actor, config.gpus_per_actor, args, log)[0]
    finally:
        if started_here:
            ray.shutdown()


def _split(targets: list[DocumentTargets], validation: float, seed: int) -> tuple[list, list]:
    """Per length, ``round(validation * n)`` (at least one) documents drawn at random are held out."""
    held_ids: set[str] = set()
    for length in sorted({t.length for t in targets}):
        ids = [t.doc_id for t in targets if t.length == length]
        held_ids.update(random.Random(f"{seed}/{length}").sample(ids, max(1, round(validation * len(ids)))))
    train = [t for t in targets if t.doc_id not in held_ids]
    held = [t for t in targets if t.doc_id in held_ids]
    if not train:
        fail("too few documents to hold some out: raise --documents")
    return train, held


MIN_LENGTH = 128  # the shortest documents the calibration is tested with (template, window and passes fit)


def preflight(config: KVzapCalibrationJob) -> None:
    """Everything that can be wrong before any work (one line, exit 2): lengths, counts that leave
    documents to fit on, the share sizes, the output file, the model (the batch jobs' checks)."""
    if not config.lengths or any(n < MIN_LENGTH for n in config.lengths):
        fail(f"invalid --lengths: give lengths of at least {MIN_LENGTH} tokens")
    counts = _per_length(config)
    held = [max(1, round(config.validation * n)) for n in counts]
    if any(n < 1 for n in counts) or sum(n - h for n, h in zip(counts, held)) < 1:
        fail(f"invalid --documents: {counts} leaves no document to fit on once {held} are held out; give more")
    if sorted(config.share_sizes) != config.share_sizes or not all(0 < s <= 1 for s in config.share_sizes):
        fail("invalid --share-sizes: ascending fractions in (0, 1]")
    output = Path(config.output).expanduser()
    if output.is_dir():
        fail(f"invalid --output: {output} is a directory; give the path of the file to write")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"invalid --output: cannot create {output.parent} ({exc.strerror})")
    if not os.access(output.parent, os.W_OK) or (output.exists() and not os.access(output, os.W_OK)):
        fail(f"invalid --output: {output} cannot be written (permissions)")
    try:
        check_model_source(config.model, bool(config.ray_address or os.environ.get("RAY_ADDRESS")))
    except JobConfigError as exc:
        fail(f"invalid {exc.field}: {exc.message}")


def main(argv: list[str] | None = None) -> int:
    parser = OptionParser(KVzapCalibrationJob, prog="jobs/calibrate_kvzap.py", description=first_paragraph(__doc__))
    config, _ = parser.parse(argv)
    preflight(config)
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {message}", file=sys.stderr, flush=True)

    loaded = load_model(config.model)
    count = lambda text: len(loaded.tokenizer(text, add_special_tokens=False).input_ids)  # noqa: E731
    docs = []
    for length, n in zip(config.lengths, _per_length(config)):
        docs += calibration_documents([length], n, count, config.seed)
    train, held = _split(_collect(config, docs, log), config.validation, config.seed)
    model, report = fit(
        train, held, config.share_sizes, config.kind, config.alpha, config.mlp_width, config.mlp_epochs,
        config.seed, progress=log, shares_by_length=config.shares_by_length, shares_target=config.shares_target,
        positions=config.positions,
    )  # fmt: skip
    settings = config.model_dump(mode="json", exclude={"output", "ray_address", "actors"})
    settings.update(train_documents=len(train), held_out_documents=len(held), seconds=round(time.perf_counter() - t0))
    path = write_kvzap(config.output, model, config.model.name, model_fingerprint(loaded.model), report, settings)
    mean = report["mean"]
    print(
        f"held-out fit over {len(held)} documents: R2 {mean['r2']:.3f}, Spearman {mean['spearman']:.3f}, "
        f"top-20% overlap {mean['top20_overlap']:.3f}; Spearman inside each document "
        f"{mean['spearman_in_document']:.3f} (mean of {len(report['layers'])} layers)"
    )
    error = report["shares_error"]
    if error["pooled"]:
        table = "per length" if config.shares_by_length else "pooled; --shares-by-length writes per length"
        by_length = ", ".join(f"{n}: {error['per_length'][n]:.2f} / {error['pooled'][n]:.2f}" for n in error["pooled"])
        print(f"held-out shares error by length, per-length / pooled table (this file: {table}): {by_length}")
    kept = "; ".join(
        f"{n}: " + ", ".join(f"{f} {v['score']:.3f} / {v['entries']:.3f}" for f, v in per.items())
        for n, per in report["kept_top"].items()
    )
    print(f"held-out kept score / KVzip's top entries kept, by length and kept fraction (this file): {kept}")
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB) in {time.perf_counter() - t0:.0f}s")
    return 0
