"""Who decides what: the server proposes how a local update runs; the node decides its privacy.

* :class:`LocalSettings` travel from the server in every instruction (as one JSON string in the
  ``config`` record): local steps, batch size, Monte Carlo draws, optimiser, damping, clip and the
  planned number of rounds. They change the utility, never the guarantee: a client calibrates its
  noise to its own budget for whatever the server plans, accounts every step it takes, and keeps
  the settings of a fit fixed from its first step (a change is refused, as ``fit_dppvi(resume=...)``
  refuses one).
* :class:`NodeSettings` come from the data holder's ``flower-supernode --node-config`` and never
  from the server: the client's id, its data file, its state folder, the model it agrees to fit,
  its budget ``(epsilon, delta)``, the neighbouring relation, accountant and sampler, and whether
  a non-private method is allowed at all (by default it is not).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

#: Methods a ClientApp runs: DP-SGD in the local step, and plain PVI (only where the node allows it).
PRIVATE_METHODS = ("dp_optimisation",)
METHODS = ("pvi",) + PRIVATE_METHODS
OPTIMIZERS = ("adam", "sgd", "cvi", "newton", "private_newton")
#: Gaussian families of q (``DPPVI(family=...)``); ``"newton"`` is the local step of non-private full-rank and
#: low-rank PVI.
FAMILIES = ("mean_field", "full_rank", "low_rank")
#: Environment variable a node must set before ``unsafe-test-fit-key`` is honoured (tests only).
TEST_KEYS_ENV = "NUMPYRO_DPPVI_FLOWER_TEST_KEYS"



log = logging.getLogger("numpyro_dppvi.flower.client")

class SettingsError(ValueError):
    """A setting is missing or wrong; the message names the key and the fix."""


@dataclass(frozen=True)
class LocalSettings:
    """The server's proposal for a client's local update (``DPPVI`` arguments of the same names).

    ``batch_size=None`` uses the client's whole data per step (not allowed for DP optimisation);
    ``planned_rounds`` is the number of participations the client's noise is calibrated for.
    """

    local_steps: int = 10
    batch_size: int | None = None
    num_samples: int = 10
    optimizer: str = "adam"
    learning_rate: float = 1e-2
    damping: float = 1.0
    clip: float = 1.0
    planned_rounds: int = 10
    tail_average: float = 0.0
    family: str = "mean_field"
    rank: int = 0  # family "low_rank": r (0: fit_dppvi's default round(sqrt(D)), resolved from the model)
    noise_aware: bool = False  # DP optimisation: noise-aware answers and posterior (fit_dppvi's noise_aware)

    def __post_init__(self):
        for name in ("local_steps", "num_samples", "planned_rounds"):
            _positive_int(name, getattr(self, name))
        if self.batch_size is not None:
            _positive_int("batch_size", self.batch_size)
        if self.optimizer not in OPTIMIZERS:
            raise SettingsError(f"optimizer={self.optimizer!r} is not known; use one of {OPTIMIZERS}")
        _positive_float("learning_rate", self.learning_rate)
        _positive_float("clip", self.clip)
        if not 0.0 < float(self.damping) <= 1.0:
            raise SettingsError(f"damping must be in (0, 1], got {self.damping}")
        if not 0.0 <= float(self.tail_average) < 1.0:
            raise SettingsError(f"tail-average must be in [0, 1), got {self.tail_average}")
        if self.family not in FAMILIES:
            raise SettingsError(f"family={self.family!r} is not available on Flower; use one of {FAMILIES}")
        if isinstance(self.rank, bool) or int(self.rank) != self.rank or self.rank < 0:
            raise SettingsError(f"rank must be a non-negative integer (0: round(sqrt(D))), got {self.rank!r}")
        if self.rank and self.family != "low_rank":
            raise SettingsError(f"rank sets the rank of family='low_rank'; family={self.family!r} has none")
        if self.optimizer == "newton" and not 0.0 < self.learning_rate <= 0.5:
            raise SettingsError(f"optimizer='newton' takes learning-rate as its precision step, in (0, 0.5]; got "
                                f"{self.learning_rate}")

    def fit_settings(self, method: str, privacy=None, schedule: str | None = None):
        """These settings as the :class:`~numpyro_dppvi.pvi.fit_settings.FitSettings` of ``fit_dppvi`` that runs the
        same local update: ``method`` and ``schedule`` (the server's; None: the method's), the named optimizer at
        ``learning-rate``, and ``privacy`` (the node's :class:`~numpyro_dppvi.privacy.Privacy`: its budget or
        noise, its sampler, and the server's clip; None for a non-private method). What the node runs
        (:func:`~numpyro_dppvi.flower.local_update.make_rule`) and what it accepts (:meth:`check_method`) are
        decided from this value, as the simulation decides from its own."""
        from ..pvi.fit_settings import FitSettings
        from .local_update import optimizer

        return FitSettings(method=method, schedule=schedule, optimizer=optimizer(self.optimizer, self.learning_rate),
                           local_steps=self.local_steps, batch_size=self.batch_size, num_samples=self.num_samples,
                           damping=float(self.damping), privacy=privacy, rounds=self.planned_rounds,
                           tail_average=float(self.tail_average), family=self.family, rank=self.rank or None,
                           noise_aware=bool(self.noise_aware))

    def check_method(self, method: str, schedule: str | None = None) -> None:
        """The settings fit ``method`` (and the server's ``schedule``, None: the method's) as they would in
        ``fit_dppvi``: one decision, the simulation's (:meth:`~numpyro_dppvi.pvi.fit_settings.FitSettings.resolve` of
        :meth:`fit_settings`), so that a combination is refused, or accepted, the same way on one machine and across
        many. A refusal is worded in the node's settings (:meth:`_refusal`) where those name it better."""
        from ..privacy import Privacy

        if self.optimizer == "private_newton" and not 0.0 < self.learning_rate <= 1.0:
            raise SettingsError(f"optimizer='private_newton' takes learning-rate as its step, in (0, 1]; got "
                                f"{self.learning_rate}")
        private = method in PRIVATE_METHODS  # a node's privacy is its own: any Privacy makes the method private
        try:
            self.fit_settings(method, Privacy(noise_multiplier=1.0, delta=1e-5, clip=self.clip) if private else None,
                              schedule).resolve()
        except (ValueError, TypeError) as exc:
            raise SettingsError(self._refusal(method) or str(exc)) from exc

    def _refusal(self, method: str) -> str | None:
        """The node-settings wording of a combination ``fit_dppvi`` refuses (optimiser names, ``learning-rate``), or
        None to keep the simulation's."""
        if method == "dp_optimisation" and self.batch_size is None:
            return "method='dp_optimisation' needs batch-size > 0 (the expected batch of each DP-SGD step)"
        if method == "dp_optimisation" and self.optimizer == "newton":
            return ("method='dp_optimisation' takes optimizer 'private_newton' (fit_dppvi's default: learning-rate its "
                    "step), 'adam', 'sgd' or 'cvi' (Newton steps with exact Hessians need the data, which DP-SGD does "
                    "not release)")
        if self.noise_aware and (method != "dp_optimisation" or self.family == "low_rank"
                                 or self.optimizer != "private_newton"):
            return ("noise-aware is available for method='dp_optimisation' with family 'mean_field' or 'full_rank' "
                    "and optimizer 'private_newton'")
        if self.optimizer == "private_newton" and (method != "dp_optimisation" or self.family == "low_rank"):
            return ("optimizer='private_newton' is the local step of method='dp_optimisation' with family "
                    "'mean_field' or 'full_rank'")
        if method == "pvi" and self.family in ("full_rank", "low_rank") and self.optimizer != "newton":
            return (f"family={self.family!r} with method='pvi' takes optimizer='newton' (learning-rate: its precision "
                    "step, e.g. 0.5)")
        if self.family == "mean_field" and self.optimizer == "newton":
            return ("optimizer='newton' is the local step of family='full_rank' or 'low_rank'; set the family or "
                    "another optimizer")
        return None

    def resolved_rank(self, dim: int) -> int:
        """The rank of a low-rank fit over ``dim`` latents (``fit_dppvi``'s rule: ``rank`` or ``round(sqrt(D))``,
        at most ``D``); 0 for the other families."""
        from ..factors import resolved_rank

        return resolved_rank(dim, self.rank) if self.family == "low_rank" else 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "LocalSettings":
        try:
            values = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise SettingsError(f"local settings are not JSON: {exc}") from exc
        if not isinstance(values, dict):
            raise SettingsError("local settings must be a JSON object")
        unknown = set(values) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise SettingsError(f"unknown local settings {sorted(unknown)}: server and node run different "
                                "versions of numpyro_dppvi; install the same version on both")
        return cls(**values)


@dataclass(frozen=True)
class NodeSettings:
    """A data holder's node configuration (``--node-config 'client-id="h1" state-dir="..." ...'``).

    Keys (Flower's kebab case): ``client-id``, ``state-dir``, ``data-file`` (an ``.npz`` file),
    ``data-arrays`` (its arrays in the model's argument order, default ``"x,y"``), ``model``
    (``"package.module:function"``, a NumPyro model importable on the node), ``epsilon`` (the node's
    total budget over every fit on its data) and ``delta``, ``neighbouring``, ``accountant``,
    ``sampling``, ``allow-non-private`` (default false), ``state-key-file`` (HMAC key for the state
    file), ``compilation-cache`` (folder of JAX's persistent cache), and the test-only
    ``unsafe-test-fit-key`` / ``unsafe-test-client-index`` (:attr:`test_fit_key`).
    """

    client_id: str
    state_dir: Path
    data_file: Path
    model: str
    data_arrays: tuple[str, ...] = ("x", "y")
    epsilon: float | None = None
    delta: float = 1e-5
    neighbouring: str = "add_remove"
    accountant: str = "pld"
    sampling: str = "poisson"
    allow_non_private: bool = False
    state_key_file: Path | None = None
    compilation_cache: Path | None = None
    test_fit_key: str | None = None
    test_client_index: int | None = None
    public_size: int | None = None

    @classmethod
    def from_node_config(cls, config) -> "NodeSettings":
        """Read and check ``context.node_config``; errors name the key to set."""
        config = dict(config)
        known = {"client-id", "state-dir", "data-file", "data-arrays", "model", "epsilon", "delta", "neighbouring",
                 "accountant", "sampling", "allow-non-private", "state-key-file", "compilation-cache",
                 "unsafe-test-fit-key", "unsafe-test-client-index", "partition-id", "num-partitions", "public-size"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise SettingsError(f"node config has unknown key(s) {unknown}; known keys: {sorted(known)}")
        for key in ("client-id", "state-dir", "data-file", "model"):
            if not str(config.get(key, "")).strip():
                raise SettingsError(f"node config needs {key}=...; start the SuperNode with "
                                    f"--node-config '{key}=\"...\" ...' (docs/deploy.md)")
        model = str(config["model"])
        if ":" not in model:
            raise SettingsError(f"node config model={model!r} must be 'package.module:function'")
        epsilon = config.get("epsilon")
        test_key = str(config.get("unsafe-test-fit-key", "")).strip() or None
        if test_key is not None and os.environ.get(TEST_KEYS_ENV) != "1":
            raise SettingsError("unsafe-test-fit-key derives the noise from a key the node was given, which voids the "
                                f"guarantee; it is for tests only and needs {TEST_KEYS_ENV}=1: remove it from the "
                                "node config")
        settings = cls(
            client_id=str(config["client-id"]), state_dir=Path(str(config["state-dir"])),
            data_file=Path(str(config["data-file"])), model=model,
            data_arrays=tuple(a.strip() for a in str(config.get("data-arrays", "x,y")).split(",") if a.strip()),
            epsilon=None if epsilon in (None, "", 0, 0.0) else _positive_float("epsilon", epsilon),
            delta=float(config.get("delta", 1e-5)), neighbouring=str(config.get("neighbouring", "add_remove")),
            accountant=str(config.get("accountant", "pld")), sampling=str(config.get("sampling", "poisson")),
            allow_non_private=_flag("allow-non-private", config.get("allow-non-private", False)),
            state_key_file=_optional_path(config.get("state-key-file")),
            compilation_cache=_optional_path(config.get("compilation-cache")),
            test_fit_key=test_key,
            test_client_index=None if test_key is None else int(config.get("unsafe-test-client-index", -1)),
            public_size=None if config.get("public-size") in (None, "", 0) else
            _positive_int("public-size", config.get("public-size")))
        if settings.test_fit_key is not None and (settings.test_client_index or 0) < 0:
            raise SettingsError("unsafe-test-fit-key needs unsafe-test-client-index (the client's index in fit_dppvi)")
        if not settings.data_arrays:
            raise SettingsError("node config data-arrays is empty; name the arrays of data-file, e.g. \"x,y\"")
        return settings

    def size_of(self, num_rows: int) -> int:
        """The size this node's settings are derived from and that it tells the server: its declared
        ``public-size`` (an upper bound the guarantee covers; :mod:`numpyro_dppvi.privacy.sizes`), else the
        number of rows, which under add/remove discloses it (logged on the node)."""
        if self.public_size is None:
            if self.neighbouring == "add_remove" and self.epsilon is not None:
                log.warning("client %s: no public-size in the node config, so the size it tells the server and "
                            "derives its sampling rate from is its number of rows, which neighbouring='add_remove' "
                            "treats as private: set public-size=<an upper bound> (docs/deploy.md)", self.client_id)
            return int(num_rows)
        if self.sampling == "without_replacement" and num_rows != self.public_size:
            raise SettingsError(f"client {self.client_id}: sampling=\"without_replacement\" draws b of the node's rows at "
                                "rate b / rows whatever public-size says (the sizes are public under substitute): "
                                "remove public-size, or use sampling=\"poisson\"")
        if num_rows > self.public_size:
            raise SettingsError(f"client {self.client_id} holds more rows than its node config public-size="
                                f"{self.public_size}; set public-size to an upper bound of what the node may hold")
        return self.public_size

    @property
    def methods(self) -> tuple[str, ...]:
        """The methods this node runs: the private ones (with a budget), and ``"pvi"`` if allowed."""
        private = PRIVATE_METHODS if self.epsilon is not None else ()
        return private + (("pvi",) if self.allow_non_private else ())

    def hmac_key(self) -> bytes | None:
        """The HMAC key of the state file (``state-key-file``), or None."""
        if self.state_key_file is None:
            return None
        key = self.state_key_file.read_bytes().strip()
        if len(key) < 16:
            raise SettingsError(f"state-key-file {self.state_key_file} holds {len(key)} bytes; use >= 16 random "
                                "bytes, e.g. `python -c \"import secrets; print(secrets.token_hex(32))\" > key`")
        return key


def _positive_int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SettingsError(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive_float(name, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise SettingsError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _flag(name, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no", ""):
        return False
    raise SettingsError(f"{name} must be true or false, got {value!r}")


def _optional_path(value) -> Path | None:
    text = "" if value is None else str(value).strip()
    return Path(text) if text else None
