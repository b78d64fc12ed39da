"""How often a speculative decoder's drafts are accepted, as the scenario gives it: the part
of vLLM's (`sim.schedulers.vllm_config.SpeculativeConfig`) and SGLang's
(`sim.schedulers.sglang_spec.SGLangSpeculativeConfig`) settings that both share. Acceptance is
data-dependent, so it is the user's to give; the draws are `sim.core.speculative`'s."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, Field, field_validator, model_validator

from sim.config.errors import INPUT_MODEL, invalid
from sim.core.speculative import conditional_rates


class AcceptanceSettings(BaseModel):
    """One acceptance rate, one per position (conditional), or the engine's printed
    per-position rates (unconditional); `_positions` says how many positions and their name."""

    model_config = INPUT_MODEL
    engine: ClassVar[str]  # whose drafter: "vllm" or "sglang" (its time: `sim.latency.base`)

    acceptance_rate: float | list[float] | None = Field(
        None, description="required, or per_position_acceptance instead: chance a draft is "
                    "accepted given that the drafts before it were: one rate, or one per "
                    "position (conditional)")
    per_position_acceptance: list[float] | None = Field(
        None, description="instead of acceptance_rate: the engine's printed per-position "
                          "acceptance rates (unconditional, non-increasing), one per position")

    def _positions(self) -> tuple[int, str]:
        """Positions a verification can accept, and the setting that makes them so."""
        raise NotImplementedError

    def _check_settings(self) -> None:
        """The other settings' checks, made before the rates' (which depend on them)."""

    @field_validator("acceptance_rate", "per_position_acceptance", mode="before")
    @classmethod
    def _numbers(cls, value: Any) -> Any:
        # One line for any other value (a union would report each of its branches).
        values = value if isinstance(value, list) else [value]
        if value is not None and not all(
                type(v) in (int, float) and math.isfinite(v) for v in values):
            raise ValueError("a rate between 0 and 1, or a list of them")
        return [float(v) for v in value] if isinstance(value, list) else (
            None if value is None else float(value))

    @model_validator(mode="after")
    def _rates(self) -> AcceptanceSettings:
        self._check_settings()
        k, setting = self._positions()
        given = self.per_position_acceptance
        if (given is None) == (self.acceptance_rate is None):
            raise invalid(("acceptance_rate", self.acceptance_rate,
                           "give it or per_position_acceptance (one of the two)"))
        rates = given if given is not None else self.acceptance_rate
        assert rates is not None
        name = "per_position_acceptance" if given is not None else "acceptance_rate"
        if isinstance(rates, list) and len(rates) != k:
            raise invalid((name, rates, f"needs one rate per draft position ({k}: {setting})"))
        values = rates if isinstance(rates, list) else [rates]
        if any(not 0 <= r <= 1 for r in values):
            raise invalid((name, rates, "rates are between 0 and 1"))
        if given is not None and any(b > a for a, b in zip(given, given[1:], strict=False)):
            raise invalid((name, given, "unconditional rates never increase with the "
                                        "position"))
        return self

    @property
    def rates(self) -> list[float]:
        """Conditional acceptance rate of each position."""
        if self.per_position_acceptance is not None:
            return conditional_rates(self.per_position_acceptance)
        rate = self.acceptance_rate
        assert rate is not None
        return list(rate) if isinstance(rate, list) else [rate] * self._positions()[0]

    def draws(self) -> list[float]:
        """Conditional acceptance rates over the drafts a decode verifies."""
        return self.rates

