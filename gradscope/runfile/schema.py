"""The run-file schema: version, paths, dtypes and the run metadata (``RunMeta``).

Everything that the writer and the reader must agree on lives here, so that ``docs/format.md``
has one source to be checked against. Shapes use N = records, K = agents, G = parameter
groups, S = declared scalar metrics, C = update components (update attribution, ``RunMeta.update_unit``).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import platform
import re
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gradscope.stats import UPDATE_EXTRAS

#: ``MAJOR.MINOR``. Minor bumps are additive (new optional fields); a reader accepts any minor of
#: a major it knows and refuses a newer major.
SCHEMA_VERSION = "1.2"
SCHEMA_MAJOR = 1
FORMAT = "gradscope-run"

# --- paths -------------------------------------------------------------------------------------
STEPS = "steps"
EVALS = "evals"
EVENTS = "events"
METRICS = "metrics"
COMMITTED = "committed"

#: ``/committed`` holds these five int64 counters, in this order. A later minor version may
#: append counters after them (never reorder), so readers use the first five.
COMMITTED_FIELDS = ("n_steps", "n_evals", "n_events", "n_metrics", "closed")

# --- string widths (bytes of UTF-8) ------------------------------------------------------------
#: ``name`` field of the long tables ``/evals`` and ``/metrics``.
NAME_BYTES = 64
EVENT_KIND_BYTES = 32
EVENT_SEVERITY_BYTES = 16
EVENT_MESSAGE_BYTES = 256
#: Appended to a free-text value that had to be cut to fit its field.
TRUNCATION_MARK = "..."

#: Rows of the long tables ``/evals`` and ``/metrics``: (step, name, value).
LONG_DTYPE = np.dtype([("step", "<i8"), ("name", f"S{NAME_BYTES}"), ("value", "<f8")])
EVAL_DTYPE = METRIC_DTYPE = LONG_DTYPE
EVENT_DTYPE = np.dtype(
    [
        ("step", "<i8"),
        ("time", "<f8"),
        ("kind", f"S{EVENT_KIND_BYTES}"),
        ("severity", f"S{EVENT_SEVERITY_BYTES}"),
        ("message", f"S{EVENT_MESSAGE_BYTES}"),
    ]
)

#: The row tables besides ``/steps``: path -> (row dtype, its counter in ``/committed``), in
#: the order of their counters.
TABLES: dict[str, tuple[np.dtype, str]] = {
    EVALS: (EVAL_DTYPE, "n_evals"),
    EVENTS: (EVENT_DTYPE, "n_events"),
    METRICS: (METRIC_DTYPE, "n_metrics"),
}
#: The long-format tables (step, name, value; free-form names).
LONG_TABLES = (EVALS, METRICS)

#: Value of ``/steps/policy`` for a record not tagged with a policy.
NO_POLICY = -1

#: ``/steps/method`` (since 1.1): what measured the record's Gram, as an index into this tuple
#: (docs/format.md and docs/probe.md explain each). Codes are only ever appended.
PROBE_METHODS = (
    "hooks",                             # 0: every call attributed by rows in one backward
    "hooks+check",                       # 1: as 0, and the self-check against split agreed
    "split",                             # 2: the probe's method is split
    "split-fallback:per-agent-losses",   # 3: a backward({agent: loss}) call (no row information)
    "split-fallback:mixed-rows",         # 4: a row holds tokens of several agents
    "split-fallback:untagged-forwards",  # 5: several untagged forwards: rows cannot be matched
    "split-fallback:unmatched-rows",     # 6: a hooked layer's input has no dimension of the batch size
    "split-fallback:check-failed",       # 7: hooks disagreed with split (method "auto"): split from then on
)
#: ``/steps/method`` of a record logged without one (and of every record of a 1.0 file).
METHOD_UNRECORDED = -1


#: What update attribution splits each optimizer step into (``RunMeta.update_unit``); "" = not recorded.
UPDATE_UNITS = ("", "role", "agent")
#: The per-record datasets of update attribution (since 1.2), present when ``update_unit`` is set.
UPDATE_FIELDS = ("update_gram", "update_interference", "update_grad_scale", "update_residual")


def step_fields(n_agents: int, n_groups: int, n_scalars: int,
                n_components: int = 0) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """The per-record datasets under ``/steps``: name -> (shape of one record, dtype).

    ``group_gram`` exists only when parameter groups were declared (``n_groups > 0``), the
    :data:`UPDATE_FIELDS` only with update attribution (``n_components`` = C > 0).
    """
    K, G, S, C = n_agents, n_groups, n_scalars, n_components
    fields: dict[str, tuple[tuple[int, ...], np.dtype]] = {
        "step": ((), np.dtype("<i8")),
        "opt_step": ((), np.dtype("<i8")),
        "policy": ((), np.dtype("<i2")),
        "time": ((), np.dtype("<f8")),
        "gram": ((K, K), np.dtype("<f8")),
        "tokens": ((K,), np.dtype("<i8")),
        "scalars": ((S,), np.dtype("<f8")),
    }
    if G:
        fields["group_gram"] = ((G, K, K), np.dtype("<f8"))
    fields["method"] = ((), np.dtype("<i1"))
    if C:
        fields["update_gram"] = ((C, C), np.dtype("<f8"))
        fields["update_interference"] = ((C, K), np.dtype("<f8"))
        fields["update_grad_scale"] = ((), np.dtype("<f8"))
        fields["update_residual"] = ((), np.dtype("<f8"))
    return fields


#: Datasets every run file must have (``group_gram`` is required only when groups are declared).
REQUIRED_STEP_FIELDS = ("step", "opt_step", "policy", "time", "gram", "tokens", "scalars")
#: Per-record datasets added by a minor version: a file of an older minor lacks them.
OPTIONAL_STEP_FIELDS = ("method",)

#: One-line descriptions, stored as each dataset's ``description`` attribute.
DESCRIPTIONS = {
    "step": "training step of the record",
    "opt_step": "running optimizer-step index",
    "policy": "index into the root attribute 'policies' (-1 = none)",
    "time": "seconds since the writer was created",
    "gram": "per-agent gradient Gram matrix M[k,l] = <g_k, g_l> over all probed parameters",
    "tokens": "number of tokens behind each agent's gradient term",
    "scalars": "scalar metrics, columns named by the attribute 'names'; NaN = not logged",
    "group_gram": "per-parameter-group Gram matrices (NaN = not logged); groups in attribute 'groups'",
    "method": "what measured the record's Gram: index into the attribute 'codes' (-1 = not recorded)",
    "update_gram": "U[a,b] = <dθ_a, dθ_b>, the optimizer step's components (attribute 'components'); NaN = not logged",
    "update_interference": "I[a,l] = <dθ_a, g_l>, component a against agent l's gradient; NaN = not logged",
    "update_grad_scale": "factor between the probed gradient and the one the optimizer used (clipping); NaN = not logged",
    "update_residual": "|dθ - sum of components| / |dθ|, the split's own check; NaN = not logged",
    EVALS: "evaluation results in long format (step, name, value)",
    EVENTS: "alerts and other events (step, time, kind, severity, message)",
    METRICS: "per-training-step metrics in long format (step, name, value)",
    COMMITTED: "n_steps, n_evals, n_events, n_metrics, closed: rows a reader may trust",
}

# --- metadata ----------------------------------------------------------------------------------

#: Root attributes stored as JSON strings (lists and dicts); the rest are plain scalars.
_JSON_ATTRS = ("agents", "agent_roles", "roles", "policies", "groups", "group_sizes", "config",
               "versions", "scalar_names")
_STR_ATTRS = ("probe_method", "created", "update_unit")


@dataclass
class RunMeta:
    """What a run is: its agents, roles, policies, parameter groups, config and provenance.

    Attributes:
        agents: agent names, K of them, in the order of the Gram matrix rows.
        agent_roles: role of each agent (length K).
        roles: role names; defaults to the roles of ``agent_roles`` in order of first appearance
            (the order ``gradscope.stats`` uses). Must contain every agent's role.
        policies: policy (parameter set) names; ``log_step(policy=...)`` refers to them.
        groups: parameter-group names; when non-empty every record has a ``group_gram``.
        group_sizes: number of parameters (numel) per group, same length as ``groups``.
        config: free-form run configuration, must be JSON-serialisable.
        seed: the run's random seed, if any.
        probe_method: how the Gram matrix is measured (e.g. ``"split"`` or ``"hooks"``, then
            ``+sketch(..)``, ``+ranks(N)``). In a file with ``/steps/method`` the reader replaces the
            method part by the methods that measured the committed records (:func:`methods_that_ran`).
        versions: library versions; filled for gradscope/torch/transformers/peft/h5py/hdf5/
            numpy/python by :meth:`with_defaults`, explicit entries win.
        created: ISO-8601 creation time; filled by :meth:`with_defaults`.
        scalar_names: every scalar metric that ``log_step(scalars=...)`` may log (declared up
            front because a SWMR file cannot grow new datasets or attributes).
        flush_every: records per flush; the writer sets it.
        update_unit: ``"role"`` or ``"agent"`` when records hold update attribution (what its
            components are, see :attr:`update_components`), ``""`` when they do not.
    """

    agents: list[str]
    agent_roles: list[str]
    roles: list[str] = field(default_factory=list)
    policies: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    probe_method: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""
    scalar_names: list[str] = field(default_factory=list)
    flush_every: int = 0
    update_unit: str = ""

    def __post_init__(self) -> None:
        # Accept any sequences (tuples, numpy string arrays) but store plain lists of str.
        self.agents = [str(a) for a in self.agents]
        self.agent_roles = [str(r) for r in self.agent_roles]
        if not self.roles:
            self.roles = list(dict.fromkeys(self.agent_roles))
        self.roles = [str(r) for r in self.roles]
        self.policies = [str(p) for p in self.policies]
        self.groups = [str(g) for g in self.groups]
        self.group_sizes = [int(n) for n in self.group_sizes]
        self.scalar_names = [str(s) for s in self.scalar_names]
        for name in ("config", "versions"):  # (a file's JSON attribute may hold any JSON value)
            if not isinstance(getattr(self, name), Mapping):
                raise ValueError(f"RunMeta.{name} must be a mapping (a JSON object), got "
                                 f"{type(getattr(self, name)).__name__}")
        self.config = dict(self.config)
        self.versions = {str(k): str(v) for k, v in self.versions.items()}
        self.validate()

    @property
    def n_agents(self) -> int:
        return len(self.agents)

    @property
    def update_components(self) -> list[str]:
        """The C components of ``/steps/update_gram``: the roles (or agents), ``unattributed``,
        ``weight_decay``; empty without update attribution."""
        if not self.update_unit:
            return []
        return [*(self.roles if self.update_unit == "role" else self.agents), *UPDATE_EXTRAS]

    def validate_new(self) -> None:
        """:meth:`validate`, and the rules for a run written now: no ``|`` in agent or role names (it separates the
        two names of a pair's column, ``cos/<A>|<B>``: "a" and "b|c" would share one with "a|b" and "c"), and no
        policy named ``all`` (the name analyses give the set of untagged records). Files written before the
        rules still read."""
        self.validate()
        if "all" in self.policies:
            raise ValueError("RunMeta.policies must not name a policy 'all' (analyses call the untagged records' "
                             "parameter set so)")
        for what, names in (("agents", self.agents), ("roles", self.roles)):
            if any("|" in n for n in names):
                raise ValueError(f"RunMeta.{what} must not contain '|' (it separates the names of a pair in columns "
                                 f"such as cos/<A>|<B>): {sorted(n for n in names if '|' in n)}")

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistency."""
        if not self.agents:
            raise ValueError("RunMeta.agents must name at least one agent")
        if len(self.agent_roles) != len(self.agents):
            raise ValueError(
                f"RunMeta.agent_roles has {len(self.agent_roles)} entries but there are "
                f"{len(self.agents)} agents"
            )
        for what, names in (("agents", self.agents), ("roles", self.roles),
                            ("policies", self.policies), ("groups", self.groups),
                            ("scalar_names", self.scalar_names)):
            dupes = sorted(n for n, count in Counter(names).items() if count > 1)  # O(n): names may be many
            if dupes:
                raise ValueError(f"RunMeta.{what} must be unique; repeated: {dupes}")
        unknown = sorted(set(self.agent_roles) - set(self.roles))
        if unknown:
            raise ValueError(f"RunMeta.agent_roles uses roles missing from RunMeta.roles: {unknown}")
        if len(self.group_sizes) != len(self.groups):
            raise ValueError(
                f"RunMeta.group_sizes has {len(self.group_sizes)} entries for {len(self.groups)} groups"
            )
        if self.update_unit not in UPDATE_UNITS:
            raise ValueError(f"RunMeta.update_unit must be one of {UPDATE_UNITS}, got {self.update_unit!r}")
        clash = sorted(set(self.update_components[:-len(UPDATE_EXTRAS)]) & set(UPDATE_EXTRAS))
        if clash:
            raise ValueError(f"RunMeta: a {self.update_unit} named {clash[0]!r} clashes with an update component")
        if len(self.policies) > np.iinfo(np.int16).max:
            raise ValueError("RunMeta.policies: at most 32767 policies")
        try:
            json.dumps(self.config, default=_json_default)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"RunMeta.config must be JSON-serialisable: {exc}") from None

    def with_defaults(self) -> RunMeta:
        """A copy with ``created`` and ``versions`` filled where empty (explicit values win)."""
        created = self.created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        return dataclasses.replace(self, created=created, versions={**library_versions(), **self.versions})

    def to_attrs(self) -> dict[str, Any]:
        """Root attributes (without ``format`` / ``schema_version``)."""
        attrs: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _JSON_ATTRS:
                attrs[f.name] = json.dumps(value, default=_json_default)
            elif f.name in _STR_ATTRS:
                attrs[f.name] = str(value)
            elif f.name == "seed":
                if value is not None:  # absent attribute = no seed
                    attrs["seed"] = np.int64(value)
            else:
                attrs[f.name] = np.int64(value)
        return attrs

    @classmethod
    def from_attrs(cls, attrs: Mapping[str, Any]) -> RunMeta:
        """Inverse of :meth:`to_attrs`; raises ``KeyError`` / ``ValueError`` on a malformed set.

        Attributes added by a later minor version are ignored; optional ones may be missing.
        """
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in attrs:
                if f.name in ("agents", "agent_roles"):
                    raise KeyError(f.name)
                continue
            value = attrs[f.name]
            if isinstance(value, bytes):
                value = value.decode("utf-8")
            if f.name in _JSON_ATTRS:
                kwargs[f.name] = json.loads(value)
            elif f.name in _STR_ATTRS:
                kwargs[f.name] = str(value)
            else:
                kwargs[f.name] = int(value)
        return cls(**kwargs)


def methods_that_ran(configured: str, codes: np.ndarray) -> str:
    """``probe_method`` naming only what ran: the base methods (``hooks`` / ``split``) of the records'
    ``/steps/method`` codes, in order of first use, joined by ``,``, then the configured suffixes
    (``+sketch(..)``, ``+ranks(N)``). Records without a code (-1) name nothing; when no record has
    one (a writer that does not record methods), ``configured`` is returned as it is."""
    if not (np.asarray(codes) >= 0).any():
        return configured
    suffix = configured[len(configured.split("+", 1)[0]):] if configured else ""
    ran = [PROBE_METHODS[c].split(":")[0].split("+")[0].replace("split-fallback", "split")
           for c in dict.fromkeys(int(c) for c in codes) if 0 <= c < len(PROBE_METHODS)]
    return ",".join(dict.fromkeys(ran)) + suffix


def _json_default(obj: Any) -> Any:
    """Let numpy scalars and arrays in a config serialise as their Python equivalents."""
    if isinstance(obj, (np.generic, np.ndarray)):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def library_versions() -> dict[str, str]:
    """Versions of the libraries a run depends on, without importing any that are not loaded.

    ``importlib.metadata`` reads the installed package's metadata, so torch is never imported
    just to learn its version; a module that is already imported reports its own ``__version__``
    (which can differ from the metadata for a development build).
    """
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for dist in ("gradscope", "torch", "transformers", "peft", "h5py", "numpy"):
        module = sys.modules.get(dist)
        version = getattr(module, "__version__", None) if module is not None else None
        if version is None:
            try:
                version = metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        versions[dist] = str(version)
    h5py = sys.modules.get("h5py")
    if h5py is not None:
        versions["hdf5"] = h5py.version.hdf5_version
    return versions


def parse_version(text: str) -> tuple[int, int]:
    """``"1.0"`` -> ``(1, 0)``; raises ``ValueError`` for anything but ``MAJOR.MINOR``."""
    match = re.fullmatch(r"([0-9]+)\.([0-9]+)", text.strip())
    if match is None:
        raise ValueError(f"expected 'MAJOR.MINOR', got {text!r}")
    return int(match.group(1)), int(match.group(2))
