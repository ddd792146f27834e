"""Matrix files (TOML, docs/runner.md): targets x prompt sets x axes -> cells.

Parsing only: nothing here starts an engine or sends a request. Every error
names the file and the offending key, and lists what is allowed. Relative
paths (prompt sets, a target's model) are resolved against the matrix file's
directory, so a matrix means the same thing from any working directory.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from tracekit.dtypes import NAMES as DTYPES
from tracekit.errors import ConfigError
from tracekit.rundir import Cell
from tracekit.runinfo import REPO_ROOT

AXES = {"concurrency": int, "dtype": str, "prefix_cache": bool, "output_tokens": int, "prompts": str}
TOP_KEYS = {"name", "description", "run", "checks", "axes", "target", "prompts"}
RUN_KEYS = {
    "ignore_eos": bool,
    "top_logprobs": int,
    "timeout_s": (int, float),
    "ready_timeout_s": (int, float),
    "repeats": int,
    "stream": bool,
    "calibration_repeats": int,
    "cold_reference": bool,
}
CHECK_KEYS = {"cancel_streams": int, "cancel_after_tokens": int, "drain_timeout_s": (int, float)}
TARGET_KEYS = {
    "name",
    "serve",
    "model",
    "command",
    "url",
    "ready_path",
    "dtype_map",
    "cache_on_args",
    "cache_off_args",
    "env",
    "api_key_env",
    "variants",
    "tokenizer",
    "eos_token_ids",
    "calibrate",
    "reset_path",
    *AXES,
}
# The other configurations of a target that `tracekit explain` reruns a flip on (docs/explain.md).
VARIANT_NAMES = ("deterministic", "fp32")
VARIANT_KEYS = {"args", "env", "dtype", "url"}
PROMPT_KEYS = {"name", "path", "input_tokens"}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Variant:
    """Another configuration of the same engine: `deterministic` (e.g. `tracekit serve
    --batch-invariant`, vLLM `VLLM_BATCH_INVARIANT=1`, SGLang `--enable-deterministic-inference`)
    or `fp32`. Its args are appended to the target's (serve args, or the command line), its env
    merged over the target's; `dtype` replaces the cell's (default: the cell's, `fp32` for the
    fp32 variant); `url` is the running server of a `url` target's variant."""

    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    dtype: str | None = None
    url: str = ""


@dataclass(frozen=True)
class Target:
    """One engine. Exactly one of: `serve` (tracekit serve args; the runner adds
    --port 0, --dtype and --no-prefix-cache), `command` (any engine command line,
    with {port} {dtype} placeholders, plus `url`), or `url` alone (a running server)."""

    name: str
    kind: str  # "tracekit" | "command" | "url"
    args: tuple[str, ...] = ()  # serve args, or the command template
    url: str = ""  # "command" (may hold {port}) and "url" targets
    ready_path: str = "/health"
    dtype_map: dict = field(default_factory=dict)  # matrix dtype -> the engine's spelling
    cache_on_args: tuple[str, ...] = ()
    cache_off_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    axes: dict = field(default_factory=dict)  # per-target axis overrides
    api_key_env: str | None = None  # send `Authorization: Bearer $VAR`; `serve` targets also get --api-key-env VAR
    variants: dict = field(default_factory=dict)  # VARIANT_NAMES -> Variant
    # Targets that are not `serve` (the reference engine reports both): the served model's HF
    # tokenizer directory (token strings -> ids, and EOS ids from its files) and EOS ids given as is.
    tokenizer: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    # May this target's repeats calibrate the yardstick (docs/runner.md, "Calibration")? Default:
    # yes, except a `serve` target with an injected fault: a calibration of a broken engine excuses its bug.
    calibrate: bool = True
    reset_path: str = ""  # POST route that empties the prefix cache (the cold reference); "" = none

    def variant(self, name: str, dtype: str) -> tuple["Target", str] | None:
        """(the target of its `name` configuration, that configuration's dtype) for a cell in
        `dtype`; None when the target names no such variant. The variant target's name is
        `<name>-<variant>`, so its engine id and log never collide with the target's."""
        v = self.variants.get(name)
        if v is None:
            return None
        t = dataclasses.replace(
            self,
            name=f"{self.name}-{name}",
            args=self.args + v.args,
            url=v.url or self.url,
            env={**self.env, **v.env},
            variants={},
        )
        return t, v.dtype or ("fp32" if name == "fp32" else dtype)

    def api_key(self) -> str | None:
        """The key to send (read from the environment, never stored); ConfigError when unset."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(
                f"target {self.name}: api_key_env {self.api_key_env}: that environment variable is unset or empty"
            )
        return key


@dataclass(frozen=True)
class PromptSet:
    name: str
    path: str
    input_tokens: str = ""  # label for reports ("128", "40-61")


@dataclass(frozen=True)
class Settings:
    ignore_eos: bool = True
    top_logprobs: int = 20
    timeout_s: float = 600.0
    ready_timeout_s: float = 300.0
    repeats: int = 1
    stream: bool = True
    cancel_streams: int = 0  # 0: min(concurrency, prompts)
    cancel_after_tokens: int = 4  # disconnect after this many streamed tokens
    drain_timeout_s: float = 15.0
    calibration_repeats: int = 1  # repeat bursts per concurrency level of each group, for the calibration (0: none)
    cold_reference: bool = True  # per group a serial capture with the prefix cache reset before each request


@dataclass(frozen=True)
class Matrix:
    path: str
    name: str
    targets: tuple[Target, ...]
    prompt_sets: tuple[PromptSet, ...]
    axes: dict
    settings: Settings
    text: str  # the file as read (copied into DIR)

    def target(self, name: str) -> Target:
        return next(t for t in self.targets if t.name == name)

    def model_dir(self, target: str) -> str:
        """The model a `serve` target runs (its --model, else the fixture model)."""
        args = self.target(target).args
        return args[args.index("--model") + 1] if "--model" in args else str(REPO_ROOT / "fixtures" / "models" / "tiny")

    def prompt_set(self, name: str) -> PromptSet:
        return next(p for p in self.prompt_sets if p.name == name)

    def cells(self) -> list[Cell]:
        """Every cell, ordered so that cells of one engine configuration are adjacent."""
        out = []
        for t in self.targets:
            ax = {**self.axes, **t.axes}
            for dt, pc, pr, ot, c in itertools.product(
                ax["dtype"], ax["prefix_cache"], ax["prompts"], ax["output_tokens"], ax["concurrency"]
            ):
                out.append(Cell(t.name, dt, pc, pr, ot, c))
        return out


def _typed(where: str, key: str, value, typ):
    ok = isinstance(value, typ) and not (typ in (int, (int, float)) and isinstance(value, bool))
    if not ok:
        want = typ.__name__ if isinstance(typ, type) else "number"
        raise ConfigError(f"{where}: '{key}' must be a {want}, got {value!r}")
    return value


def _table(where: str, obj, allowed) -> dict:
    if not isinstance(obj, dict):
        raise ConfigError(f"{where}: expected a table")
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
    return obj


def _axis(where: str, key: str, value) -> list:
    vals = value if isinstance(value, list) else [value]
    if not vals:
        raise ConfigError(f"{where}: '{key}' is empty")
    for v in vals:
        _typed(where, key, v, AXES[key])
    if key == "dtype" and any(v not in DTYPES for v in vals):
        raise ConfigError(f"{where}: dtype {vals}: each must be one of {', '.join(DTYPES)}")
    if key in ("concurrency", "output_tokens") and any(v < 1 for v in vals):
        raise ConfigError(f"{where}: '{key}' values must be >= 1, got {vals}")
    if len(set(vals)) != len(vals):
        raise ConfigError(f"{where}: '{key}' lists a value twice: {vals}")
    return vals


def _strs(where: str, key: str, v) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{where}: '{key}' must be a list of strings")
    return tuple(v)


def _target(where: str, t: dict, base: Path) -> Target:
    _table(where, t, TARGET_KEYS)
    name = t.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"{where}: 'name' must be a word of letters, digits, '_', '-', '.'")
    kinds = [k for k in ("serve", "command") if k in t] or (["url"] if "url" in t else [])
    if len(kinds) != 1:
        raise ConfigError(
            f"{where} ({name}): give exactly one of 'serve' (tracekit serve args), "
            "'command' (+ 'url') or 'url' (a running server)"
        )
    kind = {"serve": "tracekit"}.get(kinds[0], kinds[0])
    if kind == "command" and not isinstance(t.get("url"), str):
        raise ConfigError(f"{where} ({name}): a 'command' target needs 'url' (may contain {{port}})")
    args = _strs(where, kinds[0], t[kinds[0]]) if kind != "url" else ()
    if "model" in t:
        if kind != "tracekit":
            raise ConfigError(f"{where} ({name}): 'model' is for 'serve' targets; put it in the command")
        args = ("--model", str((base / _typed(where, "model", t["model"], str)).resolve())) + args
    axes = {k: _axis(f"{where} ({name})", k, t[k]) for k in AXES if k in t}
    if kind == "url" and (len(axes.get("dtype", [0, 0])) != 1 or len(axes.get("prefix_cache", [0, 0])) != 1):
        raise ConfigError(
            f"{where} ({name}): a 'url' target is one fixed engine: set 'dtype' and "
            "'prefix_cache' to the single values it runs with"
        )
    return Target(
        name,
        kind,
        args,
        str(t.get("url", "")),
        str(t.get("ready_path", "/health")),
        dict(t.get("dtype_map", {})),
        _strs(where, "cache_on_args", t.get("cache_on_args", [])),
        _strs(where, "cache_off_args", t.get("cache_off_args", [])),
        dict(t.get("env", {})),
        axes,
        _api_key_env(where, name, t),
        _variants(f"{where} ({name})", kind, t.get("variants", {})),
        *_model_facts(f"{where} ({name})", kind, t, base),
        _typed(f"{where} ({name})", "calibrate", t.get("calibrate", "--inject-fault" not in args), bool),
        _reset_path(f"{where} ({name})", t.get("reset_path", "/reset_prefix_cache" if kind == "tracekit" else "")),
    )


def _model_facts(where: str, kind: str, t: dict, base: Path) -> tuple[str | None, tuple[int, ...]]:
    """`tokenizer` (a directory, relative to the matrix file) and `eos_token_ids` (a list of ids)."""
    if kind == "tracekit" and ("tokenizer" in t or "eos_token_ids" in t):
        raise ConfigError(
            f"{where}: 'tokenizer' and 'eos_token_ids' are for targets that are not 'serve' "
            "(tracekit serve reports its model's tokenizer and EOS ids)"
        )
    tok = None
    if "tokenizer" in t:
        tok = (base / _typed(where, "tokenizer", t["tokenizer"], str)).resolve()
        if not (tok / "tokenizer.json").is_file():
            raise ConfigError(
                f"{where}: tokenizer {tok} holds no tokenizer.json (give the served model's HF directory)"
            )
    eos = t.get("eos_token_ids", [])
    if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
        raise ConfigError(f"{where}: 'eos_token_ids' must be a list of token ids (integers >= 0), got {eos!r}")
    return (str(tok) if tok else None), tuple(eos)


def _reset_path(where: str, v) -> str:
    if not isinstance(v, str) or (v and not v.startswith("/")):
        raise ConfigError(f"{where}: 'reset_path' must be a route starting with '/' (e.g. /reset_prefix_cache) or \"\"")
    return v


def _variants(where: str, kind: str, doc) -> dict:
    """[target.variants.deterministic] / [target.variants.fp32] tables -> Variant records."""
    _table(f"{where} variants", doc, VARIANT_NAMES)
    out = {}
    for name, v in doc.items():
        w = f"{where} variants.{name}"
        _table(w, v, VARIANT_KEYS)
        dtype = v.get("dtype")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"{w}: dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
        url = v.get("url", "")
        if not isinstance(url, str) or (kind == "url" and not url):
            raise ConfigError(f"{w}: a 'url' target's variant is another running server: give its 'url'")
        if kind != "url" and url:
            raise ConfigError(f"{w}: 'url' is for variants of 'url' targets; this target is started by the runner")
        env = v.get("env", {})
        if not isinstance(env, dict):
            raise ConfigError(f"{w}: 'env' must be a table of VAR = \"value\"")
        out[name] = Variant(_strs(w, "args", v.get("args", [])), {k: str(x) for k, x in env.items()}, dtype, url)
    return out


def _api_key_env(where: str, name: str, t: dict) -> str | None:
    v = t.get("api_key_env")
    if v is not None and (not isinstance(v, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v)):
        raise ConfigError(f"{where} ({name}): 'api_key_env' must name an environment variable, got {v!r}")
    return v


def _prompt_set(where: str, p: dict, base: Path) -> PromptSet:
    _table(where, p, PROMPT_KEYS)
    name, path = p.get("name"), p.get("path")
    if not isinstance(name, str) or not _NAME.match(name) or not isinstance(path, str):
        raise ConfigError(f"{where}: needs 'name' (a word) and 'path' (a JSONL prompt set)")
    full = (base / path).resolve()
    if not full.is_file():
        raise ConfigError(f"{where} ({name}): prompt set {full} does not exist (paths are relative to the matrix file)")
    return PromptSet(name, str(full), str(p.get("input_tokens", "")))


def _settings(where: str, doc: dict) -> Settings:
    run = _table(f"{where} [run]", doc.get("run", {}), RUN_KEYS)
    chk = _table(f"{where} [checks]", doc.get("checks", {}), CHECK_KEYS)
    vals = {k: _typed(f"{where} [run]", k, v, RUN_KEYS[k]) for k, v in run.items()}
    vals.update({k: _typed(f"{where} [checks]", k, v, CHECK_KEYS[k]) for k, v in chk.items()})
    s = Settings(**vals)
    if s.repeats < 1 or s.top_logprobs < 0 or s.timeout_s <= 0 or s.cancel_after_tokens < 1:
        raise ConfigError(f"{where}: repeats and cancel_after_tokens must be >= 1, top_logprobs >= 0, timeout_s > 0")
    if s.calibration_repeats < 0:
        raise ConfigError(f"{where} [run]: calibration_repeats must be >= 0 (0: no calibration)")
    return s


def load_matrix(path: str | Path) -> Matrix:
    """Read, validate and resolve a matrix file; raises ConfigError naming the key at fault."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        doc = tomllib.loads(text)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the matrix file ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    where, base = str(path), path.resolve().parent
    _table(where, doc, TOP_KEYS)
    targets = [_target(f"{where} [[target]] #{i + 1}", t, base) for i, t in enumerate(doc.get("target", []))]
    psets = [_prompt_set(f"{where} [[prompts]] #{i + 1}", p, base) for i, p in enumerate(doc.get("prompts", []))]
    if not targets or not psets:
        raise ConfigError(f"{where}: needs at least one [[target]] and one [[prompts]] table")
    for what, items in (("target", targets), ("prompts", psets)):
        names = [x.name for x in items]
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: two [[{what}]] tables share a name: {names}")
    axes_doc = _table(f"{where} [axes]", doc.get("axes", {}), AXES)
    axes = {
        "concurrency": [4],
        "dtype": ["fp32"],
        "prefix_cache": [True],
        "output_tokens": [32],
        "prompts": [p.name for p in psets],
    }
    axes.update({k: _axis(f"{where} [axes]", k, v) for k, v in axes_doc.items()})
    known = {p.name for p in psets}
    for t in targets:
        unknown = set({**axes, **t.axes}["prompts"]) - known
        if unknown:
            raise ConfigError(
                f"{where}: prompts {sorted(unknown)} (target {t.name}) are not [[prompts]] "
                f"names; known: {sorted(known)}"
            )
    name = doc.get("name", path.stem)
    return Matrix(str(path), str(name), tuple(targets), tuple(psets), axes, _settings(where, doc), text)
