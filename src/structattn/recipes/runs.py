"""Run orchestration shared by every recipe: run directories, seeded runs in parallel,
resume, best-run selection, summaries, ``reproduce`` grids, results files and tables, and
loading a trained run back (:func:`resolve_run`, :func:`load_vocabulary_run`).

A *run directory* holds one trained model (``fit``'s files) and, once scored, ``done.json``
(its record: seed, seconds, fit summary, validation and test scores). Its state is ``new``
(nothing there), ``partial`` (training started: resumable from ``checkpoint.pt``) or
``done``. An existing run is never overwritten silently: ``resume`` keeps finished runs and
continues the others, ``force`` deletes and retrains them, neither is an error.

A *cell* is one configuration of a recipe (one variant and setting): a run directory, or for
multi-run recipes ``run_00/ ... run_NN/`` (seeds ``seed``, ``seed + 1``, ...) with
``summary.json`` and the best run's ``test_predictions.jsonl``. ``reproduce`` trains a grid of
cells and writes ``results.json`` and ``table.md`` (ours beside the paper's).

Every result file is written atomically (a temporary file renamed over the target). One
process at a time writes an output directory: ``train`` and ``reproduce`` hold an OS lock on
``<out>/.structattn.lock`` (:func:`writer_lock`) while they run, and refuse a second writer.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import torch

from ..io import FileLockBusyError, atomic_write_text, file_lock
from ..training import ArtefactError, read_json_object, read_jsonl_objects, read_run_config
from .base import RESUMABLE, Recipe, RecipeConfig
from .config import config_from_dict, config_to_dict, replace_path
from .tables import markdown_table

__all__ = [
    "LOCK_FILE",
    "RunDirectoryBusyError",
    "RunJob",
    "available_cores",
    "execute",
    "final_train_loss",
    "load_vocabulary_run",
    "markdown_table",
    "plan_runs",
    "rank",
    "read_records",
    "reproduce",
    "resolve_run",
    "run_state",
    "summarize_cell",
    "train_cell",
    "write_json",
    "write_jsonl",
    "writer_lock",
]

C = TypeVar("C", bound=RecipeConfig)  # a recipe's config dataclass
RunState = Literal["new", "partial", "done"]
_RUN_FILES = ("done.json", "checkpoint.pt", "model.pt", "config.json", "metrics.jsonl")
_CELL_FILES = ("summary.json", "test_predictions.jsonl")
_RECORD_KEYS = ("run", "seconds")  # of a done.json, read here
LOCK_FILE = ".structattn.lock"  # in an output directory while train/reproduce write it


# ---- files ------------------------------------------------------------------------------------
def write_json(path: str | os.PathLike[str], payload: Any) -> Path:
    """``payload`` as indented JSON, atomically."""
    return atomic_write_text(path, json.dumps(payload, indent=2, default=str) + "\n")


def write_jsonl(path: str | os.PathLike[str], records: Iterable[Mapping[str, Any]]) -> Path:
    """One JSON object per line (predictions: one line per example), atomically."""
    return atomic_write_text(path, "".join(json.dumps(dict(r)) + "\n" for r in records))


def rank() -> int:
    """This process's rank under ``torchrun`` (0 otherwise)."""
    return int(os.environ.get("RANK", "0"))


def available_cores() -> int:
    """CPU cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ---- run directories -------------------------------------------------------------------------
def run_state(run_dir: str | os.PathLike[str]) -> RunState:
    """``done`` (``done.json``), ``partial`` (any of fit's files) or ``new``."""
    path = Path(run_dir)
    if (path / "done.json").exists():
        return "done"
    return "partial" if any((path / name).exists() for name in _RUN_FILES) else "new"


def _delete_run(run_dir: Path) -> None:
    """Delete a run's files (the writer's lock file, if it is here, stays: it is held)."""
    if run_dir.is_dir() and run_state(run_dir) != "new":
        for path in run_dir.iterdir():
            if path.name == LOCK_FILE:
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


class RunDirectoryBusyError(FileExistsError):
    """Another process is writing the output directory (it holds its lock)."""


@contextmanager
def writer_lock(out_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the exclusive lock of ``out_dir`` (:func:`structattn.io.file_lock` on
    :data:`LOCK_FILE`, released by the OS when the holder dies, even by ``kill -9``); a second
    writer gets a :class:`RunDirectoryBusyError` at once. Under ``torchrun`` rank 0 holds it
    for all ranks; where ``fcntl`` is missing (Windows) nothing is locked."""
    if rank() != 0:
        yield
        return
    out = Path(out_dir)
    created = not out.exists()
    try:
        with ExitStack() as held:
            try:
                held.enter_context(file_lock(out / LOCK_FILE, timeout=0, remove=True))
            except FileLockBusyError as busy:
                raise RunDirectoryBusyError(
                    f"{out} is being written by another structattn process (pid "
                    f"{busy.holder}); wait for it or use another --out"
                ) from None
            yield
    finally:
        if created:  # a refused command leaves no empty --out (another writer may fill it)
            with suppress(OSError):
                out.rmdir()


@dataclass(frozen=True)
class RunJob(Generic[C]):
    """One run to train: the recipe, its config (``train.seed`` = the run's seed), where."""

    recipe: str  # registered name
    config: C  # the run's config
    run_dir: Path  # its run directory
    resume: bool  # continue from run_dir/checkpoint.pt


def _cell_runs(recipe: Recipe[C], config: C, out_dir: Path) -> list[tuple[Path, C]]:
    """(run dir, run config) of every run of a cell (a multi-run config's ``runs``)."""
    if not recipe.multi_run:
        return [(out_dir, config)]
    seed = config.train.seed
    return [
        (out_dir / f"run_{r:02d}", replace_path(config, {"train.seed": seed + r}))
        for r in range(int(getattr(config, "runs", 1)))
    ]


def plan_runs(
    recipe: Recipe[C], config: C, out_dir: str | os.PathLike[str], resume: bool, force: bool
) -> list[RunJob[C]]:
    """The runs of a cell still to train. An existing run is an error unless ``resume``
    (finished runs kept, partial ones continued) or ``force`` (deleted and retrained)."""
    if resume and force:
        raise ValueError("pass --resume or --force, not both")
    out = Path(out_dir)
    jobs = []
    leader = rank() == 0  # under torchrun, rank 0 checks and deletes; the others follow
    if force and leader:
        for name in _CELL_FILES if recipe.multi_run else ():
            (out / name).unlink(missing_ok=True)
    for run_dir, run_config in _cell_runs(recipe, config, out):
        state = run_state(run_dir)
        if state != "new" and force and leader:
            _delete_run(run_dir)
            state = "new"
        elif state != "new" and not (resume or force) and leader:
            raise FileExistsError(
                f"{run_dir} already holds a {state} run; pass --resume to continue it (finished "
                "runs are kept), --force to delete and retrain it, or choose another --out"
            )
        if state != "new" and resume:
            _check_same_config(recipe, run_config, run_dir)
        if state == "done" and not force:
            continue
        can_resume = (run_dir / "checkpoint.pt").exists() and not force
        jobs.append(RunJob(recipe.name, run_config, run_dir, resume and can_resume))
    return jobs


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}{key}.").items()
        }
    return {prefix[:-1]: value}


def _check_same_config(recipe: Recipe[C], config: C, run_dir: Path) -> None:
    """``--resume`` continues a run only with the config it was started with (up to the
    fields in ``RESUMABLE``, ``recipe.resumable`` and the number of runs)."""
    raw = read_run_config(run_dir)  # an unreadable config.json: the checkpoint's copy, or none
    if raw is None:
        return
    saved = _flat(config_to_dict(config_from_dict(recipe.config, raw)))
    given = _flat(config_to_dict(config))
    allowed = RESUMABLE | recipe.resumable | ({"runs"} if recipe.multi_run else set())
    changed = sorted(k for k in given if k not in allowed and saved.get(k) != given[k])
    if changed:
        shown = ", ".join(f"{k} {saved.get(k)!r} -> {given[k]!r}" for k in changed)
        raise ValueError(
            f"{run_dir} was trained with another config ({shown}); --resume needs the same "
            "settings: pass them (or --force to retrain, or another --out)"
        )


def final_train_loss(run_dir: str | os.PathLike[str]) -> float | None:
    """The training loss of the run's last logged epoch (``metrics.jsonl``; ``None`` when no
    epoch was logged)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    last = None
    for entry in read_jsonl_objects(path):  # a line cut short by a killed run is skipped
        if entry.get("kind") == "epoch" and "train_loss" in entry:
            last = float(entry["train_loss"])
    return last


def run_one(recipe: Recipe[C], job: RunJob[C]) -> dict[str, Any] | None:
    """Train and score one run; write and return its ``done.json`` record (``None`` on
    ranks > 0 under torchrun, which only train)."""
    started = time.time()
    info = recipe.train(job.config, job.run_dir, job.resume)
    if rank() != 0:
        return None
    seconds = time.time() - started
    scores = recipe.score(job.config, job.run_dir)
    record = {
        "run": job.run_dir.name,
        "seed": job.config.train.seed,
        "best_epoch": info.get("best", {}).get("epoch", job.config.train.epochs),
        "seconds": seconds,
        "train": info,
        "final_train_loss": final_train_loss(job.run_dir),
        **scores,
    }
    write_json(job.run_dir / "done.json", record)
    return record


def _exit_with_parent(parent: int) -> None:
    """Initializer of the worker processes: exit when the parent process ``parent`` dies
    (``kill -9`` included), rather than train on for nobody. On Linux the kernel sends
    SIGTERM (``prctl(PR_SET_PDEATHSIG)``); everywhere a watchdog thread sees the worker
    reparented (``os.getppid()`` changes) within a second and exits."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the watchdog
            pass
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="structattn-parent-watchdog", daemon=True).start()


def _worker(module: str, name: str, config: dict[str, Any], run_dir: str, resume: bool,
            threads: int) -> dict[str, Any] | None:  # fmt: skip
    """One run in a worker process (spawned): the recipe is looked up in the registry, else
    in its module's ``RECIPE`` (recipes registered at run time, outside the package)."""
    from . import get, register

    torch.set_num_threads(threads)
    found = importlib.import_module(module)
    try:
        recipe = get(name)
    except ValueError:
        recipe = register(found.RECIPE)
    job = RunJob(name, config_from_dict(recipe.config, config), Path(run_dir), resume)
    return run_one(recipe, job)


def execute(
    recipe: Recipe[C],
    jobs: Sequence[RunJob[C]],
    workers: int = 1,
    on_done: Callable[[RunJob[C]], None] | None = None,
    progress: bool = False,
) -> None:
    """Train ``jobs``, ``workers`` processes at a time; the torch threads (``--threads``, or
    torch's default) are split between them. ``on_done(job)`` runs here after each run."""
    bar: Any = None
    if progress and jobs:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(jobs), desc=f"{recipe.name} runs", unit="run", file=sys.stderr)
        except ImportError:
            bar = None

    def finished(job: RunJob[C]) -> None:
        if on_done is not None:
            on_done(job)
        if bar is not None:
            bar.update(1)

    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        for job in jobs:
            run_one(recipe, job)
            finished(job)
    else:
        threads = max(1, torch.get_num_threads() // workers)
        module = recipe.train.__module__
        context, parent = get_context("spawn"), (os.getpid(),)
        with ProcessPoolExecutor(
            workers, mp_context=context, initializer=_exit_with_parent, initargs=parent
        ) as pool:
            futures: dict[Future[Any], RunJob[C]] = {}
            queue = list(jobs)
            while queue or futures:
                while queue and len(futures) < 2 * workers:
                    job = queue.pop(0)
                    quiet = replace_path(job.config, {"train.progress": False})
                    args = (module, recipe.name, config_to_dict(quiet), str(job.run_dir))
                    futures[pool.submit(_worker, *args, job.resume, threads)] = job
                done, _ = wait(list(futures), return_when=FIRST_COMPLETED)
                for future in done:
                    job = futures.pop(future)
                    future.result()  # re-raise a worker's error
                    finished(job)
    if bar is not None:
        bar.close()


# ---- cells -----------------------------------------------------------------------------------
def read_records(recipe: Recipe[C], out_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``done.json`` records of a cell's finished runs, best on validation first (records
    written before ``final_train_loss`` was kept get it from the run's ``metrics.jsonl``)."""
    out = Path(out_dir)
    paths = sorted(out.glob("run_*/done.json")) if recipe.multi_run else [out / "done.json"]
    scored = []
    for path in paths:
        if path.exists():
            record = read_json_object(path, keys=_RECORD_KEYS)
            if "final_train_loss" not in record:
                record["final_train_loss"] = final_train_loss(path.parent)
            try:
                score = recipe.report.select(record)
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                raise ArtefactError(path, f"not a finished run's record ({error!r})") from None
            scored.append((score, record))
    scored.sort(key=lambda item: item[0], reverse=True)  # stable: ties keep their order
    return [record for _, record in scored]


def summarize_cell(
    recipe: Recipe[C], config: C, out_dir: str | os.PathLike[str], final: bool = True
) -> dict[str, Any] | None:
    """The cell's summary (``None`` before any run finished): the best run on validation and
    the recipe's numbers. Multi-run cells write ``summary.json`` and, when ``final``, copy the
    best run's ``test_predictions.jsonl`` beside it."""
    out = Path(out_dir)
    records = read_records(recipe, out)
    if not records:
        return None
    summary = {
        "best_run": records[0]["run"],
        "runs": len(records),
        **recipe.report.summarize(config, records),
        "seconds_per_run": sum(r["seconds"] for r in records) / len(records),
    }
    if recipe.multi_run:
        summary["config"] = config_to_dict(config)
        summary["run_scores"] = [
            {
                k: r.get(k)
                for k in (
                    "run",
                    "seed",
                    "best_epoch",
                    "seconds",
                    "final_train_loss",
                    "valid",
                    "test",
                )
            }
            for r in records
        ]
        predictions = out / records[0]["run"] / "test_predictions.jsonl"
        if final and predictions.exists():
            atomic_write_text(out / "test_predictions.jsonl", predictions.read_text())
        write_json(out / "summary.json", summary)
    return summary


def train_cell(
    recipe: Recipe[C],
    config: C,
    out_dir: str | os.PathLike[str],
    resume: bool = False,
    force: bool = False,
    jobs: int = 1,
) -> dict[str, Any] | None:
    """``structattn train``: the cell's runs (``jobs`` in parallel), then its summary
    (``None`` on ranks > 0 under torchrun)."""
    with writer_lock(out_dir):
        pending = plan_runs(recipe, config, out_dir, resume, force)
        progress = config.train.progress and jobs > 1
        execute(recipe, pending, jobs, progress=progress)
        if rank() != 0:
            return None
        return summarize_cell(recipe, config, out_dir)


def resolve_run(recipe: Recipe[C], checkpoint: str | os.PathLike[str]) -> Path:
    """The run directory of ``checkpoint``: a run directory, its ``model.pt``, or a
    multi-run cell (its best run on validation)."""
    path = Path(checkpoint)
    if path.suffix == ".pt":
        return path.parent
    if (path / "model.pt").exists():
        return path
    if recipe.multi_run and (path / "summary.json").exists():
        return path / str(read_json_object(path / "summary.json", keys=("best_run",))["best_run"])
    raise FileNotFoundError(f"no trained model (model.pt) in {path}")


def load_vocabulary_run(
    run_dir: str | Path,
    device: str,
    recipe: str,
    config_class: type[C],
    build_model: Callable[[C, int, int], Any],
) -> tuple[Any, Any, C, dict[str, Any]]:
    """The best model of a run of a recipe whose checkpoints keep its word vocabulary and
    embedding size in ``extra`` (``vocab``, ``embed_dim``): ``(model in eval mode on
    device, WordVocabulary, config, extra)`` from one read of ``model.pt``; ``ValueError``
    for another recipe's run. ``build_model(config, vocabulary size, embedding size)``."""
    from ..data.classification import WordVocabulary
    from ..training import load_model_state

    state = load_model_state(run_dir)
    if state["config"].get("recipe") != recipe:
        raise ValueError(f"{run_dir} is not an {recipe} run ({state['config'].get('recipe')!r})")
    config = config_from_dict(config_class, state["config"])
    vocab = WordVocabulary.from_dict(state["extra"]["vocab"])
    model = build_model(config, len(vocab), int(state["extra"]["embed_dim"]))
    model.load_state_dict(state["model"])
    return model.to(device).eval(), vocab, config, state["extra"]


# ---- reproduce --------------------------------------------------------------------------------
def reproduce(
    recipe: Recipe[C],
    config: C,
    out_dir: str | os.PathLike[str],
    grid: Mapping[str, Sequence[Any]],
    resume: bool = False,
    force: bool = False,
    jobs: int = 1,
    quiet: bool = False,
) -> dict[str, Any]:
    """Train every cell of ``grid`` (config field -> values; runs interleaved so that the
    cells fill up evenly), keep ``results.json`` and ``table.md`` up to date as runs finish,
    print our table beside the paper's (unless ``quiet``); returns the results payload.
    Holds ``out_dir``'s writer lock throughout (:func:`writer_lock`)."""
    with writer_lock(out_dir):
        return _reproduce(recipe, config, Path(out_dir), grid, resume, force, jobs, quiet)


def _reproduce(
    recipe: Recipe[C],
    config: C,
    out: Path,
    grid: Mapping[str, Sequence[Any]],
    resume: bool,
    force: bool,
    jobs: int,
    quiet: bool,
) -> dict[str, Any]:
    fields = list(grid)
    cells: dict[tuple[Any, ...], tuple[C, Path]] = {}
    per_cell: list[list[RunJob[C]]] = []
    for values in itertools.product(*(grid[f] for f in fields)):
        cell_config = replace_path(config, dict(zip(fields, values, strict=True)))
        cell_dir = out / recipe.cell(cell_config)
        cells[values] = (cell_config, cell_dir)
        per_cell.append(plan_runs(recipe, cell_config, cell_dir, resume, force))
    # interleave: run 0 of every cell, then run 1, ...
    pending = [
        cell[i]
        for i in range(max(map(len, per_cell), default=0))
        for cell in per_cell
        if i < len(cell)
    ]
    started = time.time()
    results: dict[tuple[Any, ...], dict[str, Any]] = {}
    by_dir = {cell_dir: key for key, (_, cell_dir) in cells.items()}

    def update(key: tuple[Any, ...], final: bool) -> None:
        cell_config, cell_dir = cells[key]
        summary = summarize_cell(recipe, cell_config, cell_dir, final=final)
        if summary is not None:
            results[key] = summary

    def write() -> dict[str, Any]:
        payload = {
            "recipe": recipe.name,
            "config": config_to_dict(config),
            "grid": {f: list(grid[f]) for f in fields},
            "cells": [
                {"cell": dict(zip(fields, key, strict=True)), "dir": str(cells[key][1]), **s}
                for key, s in results.items()
            ],
            "paper": recipe.report.paper,
            "seconds": time.time() - started,
        }
        write_json(out / "results.json", payload)
        atomic_write_text(out / "table.md", recipe.report.format_table(results) + "\n")
        return payload

    def on_done(job: RunJob[C]) -> None:
        key = by_dir[job.run_dir.parent if recipe.multi_run else job.run_dir]
        update(key, final=False)
        write()

    out.mkdir(parents=True, exist_ok=True)
    for key in cells:  # runs finished earlier (--resume)
        update(key, final=False)
    execute(recipe, pending, jobs, on_done, progress=config.train.progress and not quiet)
    for key in cells:
        update(key, final=True)
    payload = write()
    if not quiet:
        print(recipe.report.format_table(results))
        if recipe.report.plots is not None:
            try:
                for path in recipe.report.plots(results, out):
                    print(f"plot written to {path}")
            except ImportError as error:
                print(f"no plots: {error}", file=sys.stderr)
    payload["results"] = results
    return payload
