"""The run record: a trace's `run` root attribute as a typed, versioned record.

`run` is JSON (docs/format.md, "The run record"). This module is its one reader:
`RunRecord.from_json` validates it, upgrades an older record version through
`UPGRADES` (a record written before versions were recorded reads as version 1)
and gives readers accessors (dtype and where it came from, the engine's
self-report, EOS ids, cache facts, engine family, dialect, concurrency, model)
instead of key paths. `to_json` is what a writer stores.

The fields readers use are typed; every other key (provenance, prompts,
pitfalls, counters, a capture's own labels) is kept as is in `extra`. This
module holds plain data only: it never reads a file and never touches h5py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import dtypes
from .errors import SchemaVersionError, TraceFormatError

RUN_VERSION = 1  # the record version this tracekit writes (stored as `run_version`)
VERSION_KEY = "run_version"

# Where a run's dtype is named, best first: the engine's self-report of its logits'
# dtype, its model dtype (tracekit serve's /v1/models meta; TGI /info; SGLang
# server info), then the capture's label (--run-meta dtype=..., the matrix cell).
DTYPE_CLAIMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine self-report (logits_dtype)", ("v1_models", "meta", "logits_dtype")),
    ("engine self-report (dtype)", ("v1_models", "meta", "dtype")),
    ("engine self-report (TGI model_dtype)", ("info", "model_dtype")),
    ("engine self-report (SGLang dtype)", ("server_info", "dtype")),
    ("engine self-report (SGLang dtype)", ("model_info", "dtype")),
)
LABEL_CLAIM = "capture label (run dtype)"


def _dig(x: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(x, Mapping):
            return None
        x = x.get(k)
    return x


def _mapping(x: Any) -> dict:
    return dict(x) if isinstance(x, Mapping) else {}


def _str(x: Any) -> str | None:
    return x if isinstance(x, str) and x else None


@dataclass(frozen=True)
class EngineReport:
    """The engine's self-report as the probe stored it (`/v1/models`, `/info`, `/props`, headers)."""

    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def meta(self) -> dict:
        """tracekit serve's `/v1/models` `meta` block ({} from other engines)."""
        return _mapping(_dig(self.raw, ("v1_models", "meta")))

    @property
    def name(self) -> str | None:
        return _str(self.meta.get("engine"))

    @property
    def owned_by(self) -> str:
        return str(_dig(self.raw, ("v1_models", "owned_by")) or "").lower()

    def answered(self, route: str) -> bool:
        """Whether the probe recorded an answer of `route` ('props', 'info', ...)."""
        return route in self.raw

    @property
    def block_size(self) -> int | None:
        b = self.meta.get("block_size")
        return b if isinstance(b, int) and not isinstance(b, bool) else None

    @property
    def prefix_cache(self) -> bool | None:
        p = self.meta.get("prefix_cache")
        return p if isinstance(p, bool) else None

    def dtype_claims(self) -> list[tuple[str, Any]]:
        """(where, value as spelled) of every place of the report that may name a dtype, best first."""
        return [(src, _dig(self.raw, path)) for src, path in DTYPE_CLAIMS]


@dataclass(frozen=True)
class DTypeLabel:
    """The dtype the capture recorded (`dtype`) and where it came from (`dtype_source`)."""

    value: str | None = None  # as recorded: fp32 | bf16 | fp16 (older traces: any spelling)
    source: str | None = None  # e.g. "engine: /info model_dtype", "--dtype"

    @property
    def name(self) -> str | None:
        """tracekit's name (dtypes.ALIASES), None when the value names no dtype."""
        return dtypes.normalise(self.value)


@dataclass(frozen=True)
class CacheFacts:
    """The prefix cache: the capture's label, where cached counts come from, the engine's report."""

    setting: str | None = None  # the capture's label: on | off | unknown
    reported_by: str | None = None  # where the dialect reports cached_tokens
    engine_prefix_cache: bool | None = None  # the engine's self-report
    block_size: int | None = None  # the engine's self-report (tokens per KV block)

    @property
    def prefix_cache(self) -> bool | None:
        """On/off: the label where it says, else the engine's report, else None (unknown)."""
        return {"on": True, "off": False}.get(str(self.setting), self.engine_prefix_cache)


def _upgrade_0_to_1(run: dict) -> dict:
    """Records written before `run_version` existed hold version 1's fields: nothing moves."""
    return {**run, VERSION_KEY: 1}


# version found -> function to the next version. An absent version reads as 0.
UPGRADES: dict[int, Callable[[dict], dict]] = {0: _upgrade_0_to_1}

_TYPED = (
    "target", "dialect", "engine", "engine_family", "model", "tokenizer", "model_dir", "eos_token_ids",
    "dtype", "dtype_source", "logprobs_mode", "logprobs_mode_source", "concurrency", "sampling", "cache",
    "mode",
)  # fmt: skip


def upgrade(run: Mapping[str, Any], where: str = "run") -> dict:
    """`run` brought to RUN_VERSION through UPGRADES; a newer version is a SchemaVersionError."""
    out = dict(run)
    v = out.get(VERSION_KEY, 0)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise TraceFormatError(f"{where}: {VERSION_KEY} {v!r} is not a record version (an int >= 1)")
    if v > RUN_VERSION:
        raise SchemaVersionError(
            f"{where}: run record version {v}, this tracekit reads up to {RUN_VERSION}; upgrade tracekit"
        )
    while v < RUN_VERSION:
        out, v = UPGRADES[v](out), v + 1
    return out


def _eos(x: Any, where: str) -> tuple[int, ...]:
    if x is None:
        return ()
    # ids stored by a writer that was handed numpy ints arrive as digit strings (json default=str)
    if not isinstance(x, (list, tuple)) or not all(
        (isinstance(t, int) and not isinstance(t, bool)) or (isinstance(t, str) and t.strip().isdigit()) for t in x
    ):
        raise TraceFormatError(f"{where}: eos_token_ids {x!r} is not a list of token ids")
    return tuple(int(t) for t in x)


def _concurrency(x: Any, where: str) -> int | None:
    if x is None or (isinstance(x, int) and not isinstance(x, bool)):
        return x
    raise TraceFormatError(f"{where}: concurrency {x!r} is not an int")


def _cache(x: Any, engine: EngineReport) -> CacheFacts:
    d = x if isinstance(x, Mapping) else {"setting": x}  # some older captures stored the label alone
    return CacheFacts(_str(d.get("setting")), _str(d.get("reported_by")), engine.prefix_cache, engine.block_size)


@dataclass(frozen=True)
class RunRecord:
    """A trace's run metadata (docs/format.md, "The run record")."""

    version: int = RUN_VERSION
    target: str | None = None  # the URL captured
    dialect: str | None = None  # how tracekit talked to it: openai | vllm | sglang | tgi | llamacpp ...
    engine: EngineReport = field(default_factory=EngineReport)
    engine_family: str | None = None  # the engine behind the dialect (recorded since the field exists)
    model: str | None = None
    tokenizer: str | None = None
    model_dir: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: DTypeLabel = field(default_factory=DTypeLabel)
    logprobs_mode: str | None = None
    logprobs_mode_source: str | None = None
    concurrency: int | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    cache: CacheFacts = field(default_factory=CacheFacts)
    mode: str | None = None  # a matrix cell's mode: burst | ...
    extra: Mapping[str, Any] = field(default_factory=dict)  # every other key, as stored

    @classmethod
    def from_json(cls, run: Mapping[str, Any], where: str = "run") -> RunRecord:
        """The record of a `run` JSON object (upgraded to RUN_VERSION); bad fields raise TraceFormatError."""
        if not isinstance(run, Mapping):
            raise TraceFormatError(f"{where}: the run metadata is not a JSON object")
        d = upgrade(run, where)
        engine = EngineReport(_mapping(d.get("engine")))
        return cls(
            version=d[VERSION_KEY],
            target=_str(d.get("target")),
            dialect=_str(d.get("dialect")),
            engine=engine,
            engine_family=_str(d.get("engine_family")),
            model=_str(d.get("model")),
            tokenizer=_str(d.get("tokenizer")),
            model_dir=_str(d.get("model_dir")),
            eos_token_ids=_eos(d.get("eos_token_ids"), where),
            dtype=DTypeLabel(d.get("dtype") if isinstance(d.get("dtype"), str) else None, _str(d.get("dtype_source"))),
            logprobs_mode=_str(d.get("logprobs_mode")),
            logprobs_mode_source=_str(d.get("logprobs_mode_source")),
            concurrency=_concurrency(d.get("concurrency"), where),
            sampling=_mapping(d.get("sampling")),
            cache=_cache(d.get("cache"), engine),
            mode=_str(d.get("mode")),
            extra={k: v for k, v in d.items() if k not in _TYPED and k != VERSION_KEY},
        )

    def to_json(self) -> dict:
        """The `run` JSON object a writer stores (every typed field, null where unknown)."""
        return {
            **self.extra,
            VERSION_KEY: self.version,
            "target": self.target,
            "dialect": self.dialect,
            "engine": dict(self.engine.raw),
            "engine_family": self.engine_family,
            "model": self.model,
            "tokenizer": self.tokenizer,
            **({"model_dir": self.model_dir} if self.model_dir else {}),
            "eos_token_ids": list(self.eos_token_ids),
            "dtype": self.dtype.value,
            "dtype_source": self.dtype.source,
            "logprobs_mode": self.logprobs_mode,
            "logprobs_mode_source": self.logprobs_mode_source,
            "concurrency": self.concurrency,
            "sampling": dict(self.sampling),
            "cache": {"reported_by": self.cache.reported_by, "setting": self.cache.setting},
            **({"mode": self.mode} if self.mode else {}),
        }

    def dtype_claims(self) -> list[tuple[str, str]]:
        """(where, tracekit's dtype name) of every place naming a dtype, best first: the engine's
        self-report, then the capture's label."""
        claims = [*self.engine.dtype_claims(), (LABEL_CLAIM, self.dtype.value)]
        return [(src, n) for src, v in claims if (n := dtypes.normalise(v))]

    @property
    def sampling_ignore_eos(self) -> bool | list | None:
        """The run's `ignore_eos` as recorded: one bool, the sorted distinct values, or None."""
        return self.sampling.get("ignore_eos")

    @property
    def prefix_cache_counters(self) -> Any:
        """The engine's prefix-cache counters around an HTTP capture (written at close), or None."""
        return self.extra.get("prefix_cache_counters")

    @property
    def pitfalls(self) -> tuple:
        """The pitfalls an HTTP capture warned of."""
        return tuple(self.extra.get("pitfalls") or ())

    @property
    def explain(self) -> dict:
        """An explain variant capture's own block ({config, repeats, cache_flush}), {} elsewhere."""
        return _mapping(self.extra.get("explain"))

    @property
    def engine_name(self) -> str | None:
        """What names the engine in a label: its self-reported name, else the dialect."""
        return self.engine.name or self.dialect


def record_of(meta: Any) -> RunRecord:
    """The run record of a RunMeta (its cached `record`), or of anything with a `run` mapping."""
    rec = getattr(meta, "record", None)
    return rec if isinstance(rec, RunRecord) else RunRecord.from_json(meta.run)
