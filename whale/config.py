"""One validated config tree for every command.

Plain pydantic models with `extra="forbid"`, so a misspelt key is an error that names the key,
not a silently ignored setting. YAML files plus `--set a.b=c` overrides (values parsed as YAML,
so `--set weight.lr=1e-4` is a float and `--set eval.splits=[val,test]` a list).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from whale.errors import WhaleError


class _Strict(BaseModel):
    """Unknown keys are errors; every number has a range (tests/test_config.py walks them all)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Strict):
    name: str = Field("smollm2-135m", description="'smollm2-135m' (offline default), an HF id, or a local folder")
    backend: Literal["hf", "vllm", "openai", "null"] = Field(
        "hf", description="hf: transformers in this process; vllm: a vLLM server; openai: any OpenAI-compatible "
        "endpoint (no training); null: a model that knows nothing (engine/null.py)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto: bf16 where it is fast (CUDA with bf16, CPUs with AVX512-bf16/AMX), else fp16 on "
        "CUDA, fp32 on CPU")
    device: str = Field("auto", description="'auto', 'cpu', 'cuda', 'cuda:1', ... (hf: the engine; vllm: the trainer)")
    base_url: str | None = Field(None, description="vllm/openai: server URL (vllm starts one if empty)")
    api_key_env: str = Field("OPENAI_API_KEY", description="openai: env var holding the key")
    max_model_len: int = Field(4096, ge=2, description="prompt + completion tokens one sequence may hold")
    max_batch_size: int = Field(64, ge=1, description="hf: most sequences generated together (64: "
                                "benchmarks/decode_width.py); vllm: requests in flight")
    kv_cache_mib: int = Field(1024, ge=1, le=999_999, description="hf: bound on the KV storage (MiB) of the "
                              "sequences in flight: they join the batch while rows x the longest prompt + "
                              "completion fit (one always runs), and at most this much stays kept between "
                              "batches; growing, one layer more (engine/kv.py). 1024: "
                              "23k tokens of SmolLM2-135M in float32, 46k in bf16")
    prefix_cache_mib: int = Field(1024, ge=0, le=999_999, description="hf: KV (MiB) of finished sequences kept "
                                  "for later prompts that extend them (an episode's next call, the samples of a "
                                  "problem); least recently used dropped first; 0: off")
    cpu_threads: int | None = Field(None, ge=1, description="hf on CPU: intra-op threads of the engine's "
                                    "decode steps; empty: OMP_NUM_THREADS if set, else the usable cores but one (the "
                                    "runner, tools and sandboxes run on the rest; docs/design.md)")
    prefill_threads: int | None = Field(None, ge=1, description="hf on CPU: intra-op threads of the engine's "
                                        "prefill and choice-scoring forwards (GEMMs over many tokens, which split "
                                        "across cores); empty: OMP_NUM_THREADS if set, else the usable cores")
    vllm_args: list[str] = Field(default_factory=list, description="vllm: extra `vllm serve` arguments")
    data_parallel_size: int = Field(1, ge=1, description="vllm: engine copies (one per GPU) behind the one server "
                                    "WHALE starts (`--data-parallel-size`); vLLM balances requests over them")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vllm: share of each GPU the server "
                                                 "takes; leave the rest to a trainer on the same GPU (docs/guides/gpu-vllm.md)")
    vllm_env: dict[str, str] = Field(default_factory=dict, description="vllm: environment of the server, e.g. "
                                     "CUDA_VISIBLE_DEVICES or VLLM_CPU_KVCACHE_SPACE (GiB)")
    vllm_max_restarts: int = Field(3, ge=0, description="vllm: times a server that died is recovered in one run")
    vllm_full_sync: Literal["rpc", "restart"] = Field(
        "rpc", description="vllm: how full fine-tuned weights reach the server: rpc reloads them in the running "
        "server (paused, prefix cache reset; a server WHALE starts gets VLLM_SERVER_DEV_MODE=1, one at base_url "
        "needs it); restart starts the server again on the checkpoint")
    colocate: bool = Field(False, description="vllm on one GPU with the trainer: the server sleeps (releases its "
                           "weights and KV cache) while the trainer steps, and wakes on the new weights; needs CUDA "
                           "(docs/guides/scale-out.md)")

    @field_validator("backend", mode="before")
    @classmethod
    def _null_backend(cls, v):
        return "null" if v is None else v  # `--set model.backend=null` parses as YAML null


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0.0, description="applied first; 0: greedy")
    top_k: int = Field(20, ge=0, description="then the k most likely tokens (0: all)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="then the nucleus of this mass")
    max_tokens: int = Field(256, ge=1, description="default per llm() call")
    max_tokens_cap: int = Field(1024, ge=1, description="largest max_tokens a harness may ask for")

    @model_validator(mode="after")
    def _cap_holds_default(self):
        if self.max_tokens > self.max_tokens_cap:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be <= max_tokens_cap ({self.max_tokens_cap})")
        return self


class BudgetConfig(_Strict):
    """Per-episode limits, enforced by the parent."""

    llm_calls: int = Field(8, ge=1, description="model calls an episode may make")
    tool_calls: int = Field(16, ge=0, description="tool calls an episode may make")
    tokens: int = Field(8192, ge=1, description="prompt + generated tokens over all calls")
    seconds: float = Field(60.0, gt=0, description="harness wall time, excluding time queued for engine/tools")
    invalid_moves: int = Field(3, ge=0, description="chess: refused moves before the episode ends")


class SplitSizes(_Strict):
    weight: int = Field(512, ge=0, description="D_weight: problems the weight phase trains on")
    harness: int = Field(64, ge=0, description="D_harness: problems the search scores candidates on")
    val: int = Field(64, ge=0, description="selects the val-best (harness, weights) pair")
    test: int = Field(64, ge=0, description="reported only; never seen by training or search")


class DomainConfig(_Strict):
    name: str = Field("searchqa", description="searchqa | math | chess, or any name with `module`")
    module: str | None = Field(None, description="user domain: 'package.module:ClassName'")
    source: str = Field("offline", description="offline (packaged data), or a loader name, see docs/domains.md")
    data_path: str | None = Field(None, description="local file/folder or HF dataset id for real data")
    corpus_path: str | None = Field(None, description="searchqa: passage corpus (jsonl/parquet) for BM25")
    retriever_url: str | None = Field(None, description="searchqa: Search-R1 style /retrieve server")
    grader: str = Field("default", description="searchqa: em | subspan | judge; math: math_verify; chess: line")
    judge_model: str | None = Field(None, description="searchqa grader judge: the OpenAI-compatible judge model")
    show_gold_in_traces: bool = Field(False, description="proposers see gold answers in the traces; a candidate "
                                      "that writes one of them into its code is refused")
    splits: SplitSizes = Field(default_factory=SplitSizes)
    budget: BudgetConfig = Field(default_factory=BudgetConfig)
    options: dict[str, Any] = Field(default_factory=dict, description="domain-specific knobs")


class SandboxConfig(_Strict):
    mode: Literal["auto", "bwrap", "process"] = Field(
        "auto", description="auto: bubblewrap when it works, else process (with a warning); docs/sandbox.md")
    memory_mb: int = Field(1024, ge=64, description="address space of one episode; a sandbox's cgroup holds up to 8x")
    max_processes: int = Field(16, ge=1, description="processes one episode may run")
    cpu_seconds: int = Field(120, ge=1, description="CPU seconds one episode may use")
    extra_packages: list[str] = Field(default_factory=list, description="third-party packages harnesses may import")


class RunnerConfig(_Strict):
    concurrency: int = Field(64, ge=1, description="episodes in flight (64 fills the hf engine's default decode width)")
    lockstep: Literal["all", "eval", "never"] = Field(
        "eval", description="batch model calls as a function of the episodes alone, not of timing "
        "(engine/lockstep.py): 'all' rollouts, 'eval' only, or 'never'; bit-exact re-runs need it")
    lockstep_hold_s: float = Field(1.0, gt=0, description="the longest the engine waits for one episode's "
                                   "due call (a slow tool); past it the batch goes on, counted as not reproducible")
    grader_processes: int = Field(2, ge=1, description="processes that grade episodes (graders may be slow: math-verify)")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)


class LoraConfig(_Strict):
    r: int = Field(16, ge=1, description="LoRA rank")
    alpha: int = Field(32, ge=1, description="LoRA scale numerator (the update is scaled by alpha / r)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA branch")
    target_modules: str | list[str] = Field("all-linear", description="PEFT target modules")


class WeightConfig(_Strict):
    problems_per_step: int = Field(16, ge=1, description="prompt batch (paper: 256)")
    samples_per_problem: int = Field(4, ge=1, description="k rollouts per problem (paper: 8)")
    accept_threshold: float = Field(0.5, description="a rollout is trained on when its reward is above this")
    finetune: Literal["lora", "full"] = Field("lora", description="LoRA adapters, or every weight (fp32 masters)")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    mini_batch_trajectories: int = Field(64, ge=1, description="trajectories per optimizer step (paper: 64)")
    micro_batch_tokens: int = Field(4096, ge=1, description="tokens per forward/backward (gradient accumulation)")
    max_grad_norm: float = Field(1.0, ge=0, description="gradient clipping (0: none)")
    gradient_checkpointing: bool = Field(True, description="recompute each layer's activations in backward: a "
                                         "step holds one layer's activations, not every layer's (off: about 1/3 "
                                         "faster steps; SmolLM2-135M in float32 then holds ~2 MB per token, about 9 GB "
                                         "for a 4,096-token micro-batch)")
    max_length: int = Field(4096, ge=2, description="training rows are cut to this many tokens")
    keep_versions: int = Field(2, ge=0, description="weights versions kept on disk besides the val-best")


class PatienceConfig(_Strict):
    window: int = Field(3, ge=1, description="steps the training accept rate is smoothed over")
    burn_in: int = Field(3, ge=0, description="steps before the phase may stop")
    patience: int = Field(3, ge=1, description="steps without a new phase-best that end the phase")


class AgentBind(_Strict):
    path: str = Field(description="host path, seen at the same path inside the sandbox; ~ is the parent's HOME")
    mode: Literal["ro", "rw", "copy"] = Field("ro", description="ro / rw: bound read-only or read-write; copy (files "
                                              "only): a private writable copy per round, changes discarded")


class HarnessSearchConfig(_Strict):
    initial: str | None = Field(None, description="harness file to start from instead of the domain's h0 "
                                "(archived as a child of h0)")
    proposer: Literal["mutation", "chat", "agent_cli"] = Field(
        "mutation", description="mutation: offline, picks mechanisms from a diagnosis of the traces; chat: an "
        "OpenAI-compatible model with file tools; agent_cli: a coding-agent CLI in a sandboxed workspace")
    domain_hints: bool = Field(True, description="on: proposers also use the domain's declared hints (its own "
                               "mechanisms, failure modes and brief text, shown as 'hint: <name>'); off: only the "
                               "domain-general mechanisms, as on a task nobody tuned them for")
    candidates_per_iteration: int = Field(3, ge=1, description="M: candidates the proposer writes per iteration")
    samples_per_example: int = Field(1, ge=1, description="k samples per harness-split problem when scoring a candidate")
    confirm_top: int = Field(2, ge=0, description="top candidates re-run on fresh seeds, with the incoming harness, "
                             "before one may replace it (0: decide on the selection traces)")
    confirm_samples: int = Field(2, ge=1, description="samples per problem of that re-run (ledger purpose confirm)")
    confirm_rounds: int = Field(1, ge=1, description="sequential confirmation: up to this many re-runs, each "
                                "confirm_samples per problem on new seeds, pooled; stops at the first that "
                                "accepts or when no candidate is ahead; alpha is split over the rounds "
                                "(harness/acceptance.py)")
    accept_alpha: float = Field(0.05, gt=0, le=1, description="one-sided level of the paired sign-flip test "
                                "(split over the candidates tested); also the null probe's level")
    accept_margin: float = Field(0.0, ge=0, description="paired gain in success rate a candidate must exceed")
    prompt_only: bool = Field(False, description="the search may edit only the prompt constants (the Fast-Slow "
                              "control; schedule.kind prompt_only sets it)")
    agent: Literal["claude_code", "codex", "command"] = Field(
        "command", description="agent_cli: a preset invocation (claude_code, codex) or agent_command")
    agent_command: str | None = Field(None, description="agent 'command': shell command; {brief} {workspace} substituted")
    agent_model: str | None = Field(None, description="claude_code/codex: --model (the CLI's default if empty)")
    agent_base_url: str | None = Field(None, description="claude_code/codex: the endpoint the agent calls instead of "
                                       "its vendor's (claude_code: ANTHROPIC_BASE_URL, e.g. http://host:port; codex: a "
                                       "provider entry, e.g. http://host:port/v1, key in OPENAI_API_KEY)")
    agent_timeout_s: float = Field(2400, gt=0, description="agent_cli: seconds one proposal round may take")
    agent_env: list[str] = Field(default_factory=list, description="agent_cli: env vars passed to the agent "
                                 "besides the preset's; all others are scrubbed except PATH, HOME, LANG")
    agent_sandbox: Literal["bwrap", "none"] = Field(
        "bwrap", description="bwrap: only the workspace is visible and writable (an error if bubblewrap does not "
        "work); none: unsandboxed, see docs/sandbox.md")
    agent_binds: list[AgentBind] | None = Field(
        None, description="host paths the sandboxed agent sees (its config), each {path, mode: ro/rw/copy}; None: the preset's "
        "(claude_code: ~/.claude rw, ~/.claude.json copy; codex: ~/.codex rw)")
    workspace_root: str | None = Field(None, description="where proposer workspaces go (outside the run "
                                       "directory); default: a private folder in the system temp dir")
    proposer_budget_usd: float | None = Field(None, gt=0, description="proposing stops (the incoming harness is kept) "
                                              "once the run's proposer rounds cost this much, as the agent reports it")
    proposer_budget_tokens: int | None = Field(None, gt=0, description="the same in proposer tokens (input + output)")
    chat_model: str | None = Field(None, description="chat: the proposer model")
    chat_base_url: str | None = Field(None, description="chat: its OpenAI-compatible endpoint")
    chat_api_key_env: str = Field("OPENAI_API_KEY", description="chat: env var holding the endpoint's key")
    chat_max_turns: int = Field(24, ge=1, description="chat: model turns per proposal round")
    chat_retries: int = Field(4, ge=0, description="chat: retries of a call on a timeout, dropped connection, 429 or 5xx")
    chat_backoff_s: float = Field(2.0, ge=0, description="chat: first retry wait, doubled each retry (max 60 s)")
    chat_history_turns: int = Field(16, ge=1, description="chat: turns sent besides the system and task messages")
    chat_history_tokens: int = Field(64_000, ge=1, description="chat: estimated tokens (4 chars each) of history sent")
    null_probe_items: int = Field(64, ge=1, description="problems the null-engine probe of a candidate runs")
    null_probe_min_drop: float = Field(0.0, ge=0, description="the model's paired advantage over the null engine must "
                                       "exceed this and be shown at accept_alpha (unless the null engine scores 0)")
    reject_flagged: bool = Field(True, description="a candidate the null probe flags is not accepted (else only "
                                 "recorded)")
    max_file_bytes: int = Field(50_000, ge=1, description="largest harness file a candidate may be")
    smoke_examples: int = Field(2, ge=0, description="episodes a candidate runs before it is scored (0: none)")
    min_iterations: int = Field(5, ge=1, description="adaptive: proposer iterations a harness phase runs at least")
    max_iterations: int = Field(15, ge=1, description="adaptive: and at most")
    patience: int = Field(2, ge=1, description="adaptive: iterations without a new best that end the phase")

    @model_validator(mode="after")
    def _iterations_in_order(self):
        if self.min_iterations > self.max_iterations:
            raise ValueError(f"min_iterations ({self.min_iterations}) must be <= max_iterations "
                             f"({self.max_iterations})")
        return self


class ScheduleConfig(_Strict):
    kind: Literal["whale", "weight_only", "harness_only", "prompt_only", "stagewise", "gain"] = Field(
        "whale", description="which phases run when (schedule.py has the table); gain: the side with the higher "
        "recent gain per rollout runs next")
    adaptive: bool = Field(False, description="phases end by patience (weight_patience; harness.patience) "
                           "instead of after E epochs / I iterations")
    weight_epochs: float = Field(0.6, gt=0, description="E: weight-phase length in epochs of D_weight")
    harness_iterations: int = Field(6, ge=1, description="I: includes re-scoring the incoming harness")
    weight_patience: PatienceConfig = Field(default_factory=PatienceConfig)
    min_weight_steps: int = Field(1, ge=1, description="adaptive: steps a weight phase runs at least")
    budget_epochs: float | None = Field(4.0, gt=0, description="weight steps of the whole run, in epochs of D_weight")
    budget_steps: int | None = Field(None, ge=1, description="weight steps of the whole run")
    budget_rollouts: int | None = Field(None, ge=1, description="rollouts of the whole run that count (training, "
                                        "search, confirmation; not evaluation); the run ends at the first budget hit")
    end_with_weight_phase: bool = Field(True, description="keep room for a weight step after the last harness "
                                        "phase, so the run trains under the harness it accepted")
    repeat_harness_phases: bool = Field(False, description="harness_only: phases of harness_iterations each "
                                        "(accept + phase-end evaluation after each) until the rollout budget ends, "
                                        "so its accuracy-vs-rollouts curve has points")
    gain_explore: int = Field(2, ge=1, description="kind gain: after this many phases in a row on one side, "
                              "the other side runs once (so a stalled side is retried); doubled for each of "
                              "that side's latest phases in a row that gained nothing (at most 8x)")


class EvalConfig(_Strict):
    k: int = Field(8, ge=1, description="samples per problem (mean@k, pass@k)")
    splits: list[str] = Field(default_factory=lambda: ["val", "test"], description="splits evaluated at the start "
                              "and the end (and between: intermediate_splits)")
    every_steps: int = Field(10, ge=0, description="evaluate every N weight steps (0: never mid-phase)")
    at_phase_ends: bool = Field(True, description="evaluate at every phase boundary (else only at start and end)")
    limit: int | None = Field(None, ge=1, description="evaluate on the first N problems of each split")
    intermediate_splits: list[str] | None = Field(None, description="splits evaluated between the initial and "
                                                  "final evaluations (default: splits), e.g. [val] to attribute "
                                                  "gains to phases cheaply and keep test for start and end")
    test_at_val_best: bool = Field(True, description="at the end of a run, evaluate the val-best (harness, weights) on "
                                   "the other eval splits when no evaluation measured them (the val-selected column)")


class ComputeConfig(_Strict):
    executor: Literal["local", "ray"] = Field("local", description="local: this process; ray: runner actors on a "
                                              "Ray cluster (docs/guides/scale-out.md)")
    ray_address: str | None = Field(None, description="ray: the cluster to join (default: start a local one)")
    train_ranks: int = Field(1, ge=1, le=1024, description="training processes of the weight phase: 1 trains in "
                             "the whale process; N > 1 starts a group of N FSDP2 ranks once per run (one per GPU, "
                             "NCCL; gloo on CPU), rank 0 saves each step's weights for the engine "
                             "(docs/guides/scale-out.md)")


class LoggingConfig(_Strict):
    """Experiment trackers fed from the metrics rows; metrics.jsonl stays the source of truth."""

    trackers: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(
        default_factory=list, description="each an optional extra: pip install 'whale-opt[tensorboard]' ...")
    project: str = Field("whale", description="wandb/trackio project, mlflow experiment")
    dir: str | None = Field(None, description="tracker files (default: RUN_DIR/trackers)")


class Config(_Strict):
    name: str = Field("run", description="the run's name; its directory is runs/<name> unless --out says otherwise")
    seed: int = Field(0, ge=0, description="seeds the splits, every rollout's sampling and the search")
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    domain: DomainConfig = Field(default_factory=DomainConfig)
    runner: RunnerConfig = Field(default_factory=RunnerConfig)
    weight: WeightConfig = Field(default_factory=WeightConfig)
    harness: HarnessSearchConfig = Field(default_factory=HarnessSearchConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)


class ConfigError(WhaleError, ValueError):
    """A config problem, already phrased for the user (key path and what is wrong); exit status 2."""

    exit_code = 2
    resumable = False


def _sibling_keys(loc: tuple) -> list[str]:
    """The keys Config accepts next to the last one of `loc` (for "did you mean")."""
    model: Any = Config
    for part in loc[:-1]:
        field = getattr(model, "model_fields", {}).get(str(part))
        model = getattr(field, "annotation", None)
        if not isinstance(model, type) or not issubclass(model, BaseModel):
            return []
    return list(model.model_fields)


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        if e["type"] == "extra_forbidden":
            near = difflib.get_close_matches(str(e["loc"][-1]), _sibling_keys(e["loc"]), n=1, cutoff=0.6)
            lines.append(f"unknown config key '{key}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
        elif e["type"] == "value_error" and isinstance(e.get("input"), dict):  # a section's own check
            lines.append(f"config section '{key}': {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"config key '{key}': {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML."""
    if "=" not in assignment:
        raise ConfigError(f"override '{assignment}' must look like key.path=value")
    path, raw = assignment.split("=", 1)
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override '{assignment}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{assignment}': '{k}' is not a section")
    node[keys[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ConfigError(f"config file not found: {p}")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {' '.join(str(e).split())}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    for o in overrides or []:
        apply_override(tree, o)
    return config_from_dict(tree)


# Keys that no longer exist: key path -> (the default every earlier run dumped, why it went).
# A run directory's saved config (which lists every key at its value) still loads; a config that
# set one to anything else is told what happened to it.
RETIRED = {("runner", "batch_window_ms"): (20.0, "continuous batching in the engine replaced the "
                                           "runner's static batcher; see runner.lockstep"),
           ("runner", "sandbox", "output_bytes"): (1_000_000, "it was never read (an episode keeps the last "
                                                   "4,000 characters it prints; files it writes are capped at 16 MiB)"),
           ("model", "mixed_forwards"): (True, "the mixed forward showed no effect on whole runs and was removed "
                                         "on 2026-12-06; delete the key"),
           ("model", "packed_gemm"): (True, "float32 packs showed no effect on whole runs and were removed on "
                                      "2026-12-06; bf16 packs give the plain bits and are always on; delete the key")}


def _drop_retired(tree: dict[str, Any]) -> dict[str, Any]:
    for path, (dumped, why) in RETIRED.items():
        parents = [tree]
        for key in path[:-1]:
            parents.append(parents[-1].get(key) if isinstance(parents[-1], dict) else None)
        part, key = parents[-1], path[-1]
        if isinstance(part, dict) and key in part:
            if part[key] != dumped:
                raise ConfigError(f"config key '{'.'.join(path)}' was removed: {why}")
            rebuilt = {k: v for k, v in part.items() if k != key}
            for parent, name in zip(reversed(parents[:-1]), reversed(path[:-1])):
                rebuilt = {**parent, name: rebuilt}
            tree = rebuilt
    return tree


def config_from_dict(tree: dict[str, Any]) -> Config:
    try:
        cfg = Config.model_validate(_drop_retired(tree) if isinstance(tree, dict) else tree)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None
    refuse_ignored_settings(cfg)
    return cfg


def refuse_ignored_settings(cfg: Config) -> None:
    """A setting the chosen mode never reads is an error naming it, not a silent no-op.

    Cross-section checks only; each domain checks its own keys (whale.domains.base.Setting).
    """
    m, default = cfg.model, ModelConfig()
    ignored = [
        ("model.base_url", m.base_url is not None and m.backend in ("hf", "null"), "model.backend vllm or openai"),
        *((f"model.{k}", getattr(m, k) != getattr(default, k) and m.backend != "vllm", "model.backend vllm")
          for k in ("vllm_args", "data_parallel_size", "gpu_memory_utilization", "vllm_env", "vllm_max_restarts",
                    "vllm_full_sync", "colocate")),
        ("model.api_key_env", m.api_key_env != default.api_key_env and m.backend != "openai", "model.backend openai"),
        ("compute.ray_address", cfg.compute.ray_address is not None and cfg.compute.executor != "ray",
         "compute.executor ray"),
        ("weight.lora", cfg.weight.lora != LoraConfig() and cfg.weight.finetune != "lora", "weight.finetune lora"),
    ]
    for key, unread, mode in ignored:
        if unread:
            raise ConfigError(f"config key '{key}' is read only with {mode}; remove it or change the mode")


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int | None`, `'hf' | 'vllm'`, `list[str]`."""
    if get_origin(annotation) is Literal:
        return " \\| ".join(repr(a) for a in get_args(annotation))
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    return text.replace("typing.", "").replace("whale.config.", "").replace("NoneType", "None").replace("|", "\\|")


def _range_text(field: Any) -> str:
    """A field's bounds as `>= 1`, `> 0, <= 1` (empty for none)."""
    parts = []
    for bound in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(bound, attr, None) is not None:
                parts.append(f"{sign} {getattr(bound, attr):g}")
    return f" ({', '.join(parts)})" if parts else ""


def config_reference() -> str:
    """Every config key with its type, default and description, as markdown (docs/config.md is
    this text; tests/test_config.py fails when the two differ or a key has no description)."""
    lines = ["# Config reference", "", "Every key `whale run` accepts, generated from whale/config.py by "
             "`whale config --reference`. Set them in a YAML file or with `--set a.b=c`; a misspelt key is an "
             "error naming the nearest one. `whale config CONFIG` prints a config with every key resolved.", ""]

    def rows(model: type[BaseModel], prefix: str):
        for key, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                yield from rows(sub, f"{prefix}{key}.")
                continue
            default = field.get_default(call_default_factory=True)
            shown = json.dumps(default.model_dump() if isinstance(default, BaseModel) else default)
            text = (field.description or "").replace("|", "\\|")
            yield f"| `{prefix}{key}` | {_type_name(sub)}{_range_text(field)} | `{shown}` | {text} |"

    top = [(k, f) for k, f in Config.model_fields.items()]
    plain = [(k, f) for k, f in top if not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))]
    header = ["| key | type | default | what it does |", "|---|---|---|---|"]
    lines += header + [f"| `{k}` | {_type_name(f.annotation)}{_range_text(f)} | `{json.dumps(f.default)}` | {f.description} |"
                       for k, f in plain] + [""]
    for key, field in top:
        if (key, field) in plain:
            continue
        section = field.annotation
        doc = " ".join((section.__doc__ or "").split())
        lines += [f"## {key}", ""] + ([doc, ""] if doc else []) + header + list(rows(section, f"{key}.")) + [""]
    return "\n".join(lines)
