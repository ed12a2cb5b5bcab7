"""An estimate answered from a portable profile: its request schema, the profile's own request, its job.

>>> req = ProfileEstimateRequest.model_validate({"profile": "sha256:" + "0" * 64, "gpus": ["T4-16GB"]})
>>> req.profile[:7], req.batch_size
('sha256:', None)

A profile fixes the model, its input and the training recipe (it holds their
steps), so a request by profile names only what the answer varies: the cards,
the batch, the planner's options; ``model``, ``input``, ``training`` and
``validate`` beside a profile are refused, all named at once. The profile's
own request is checked by the request's schema, its model as a label only: it
is never built, so a custom factory's profile is answered without its code.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator
from pydantic_core import PydanticCustomError

from estimator.errors import SpecError
from estimator.models.allowed import refuse_paths
from estimator.options import MAX_BATCH, MAX_CARDS, ConfirmMode
from estimator.portable.profile import PortableProfile
from estimator.portable.schema import ID_PATTERN
from estimator.request.adapt import Job, job_of
from estimator.request.parse import FIXED_ERROR, parse_request, validated
from estimator.request.spec import EstimateRequest, GPUEntry, PlannerSpec

FIXED_BY_PROFILE = ("model", "input", "training", "validate")  # what a profile holds, or cannot do


# a stored profile's id, or the profile itself (its branch named by its JSON type, so an error names the field)
ProfileRef = Annotated[
    Annotated[str, Tag("str")] | Annotated[dict[str, Any], Tag("dict[str,any]")],
    Discriminator(lambda v: "str" if isinstance(v, str) else "dict[str,any]" if isinstance(v, dict) else None,
                  custom_error_type="profile_ref", custom_error_message="a stored profile's id (sha256:...) or the "
                  "profile itself as an object"),
]


class ProfileEstimateRequest(BaseModel):
    """``POST /estimate`` by profile: the stored profile's id, or the profile itself, and the cards."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    profile: ProfileRef = Field(
        description="a stored profile's id (POST /profiles answers it: sha256 of its canonical JSON), or the "
                    "profile itself, as `batchfit profile` writes it", examples=["sha256:" + "0" * 64])
    gpus: list[GPUEntry] | None = Field(None, min_length=1, max_length=MAX_CARDS,
                                        description="catalog names or custom cards; null: the whole catalog")
    batch_size: int | None = Field(None, ge=1, le=MAX_BATCH, description="also report memory at exactly this batch")
    planner: PlannerSpec = Field(default_factory=PlannerSpec, description="the planner's options; those left "
                                 "out are the profile's (its request's planner section); confirm is always "
                                 "'none': a profile simulates nothing")

    @field_validator("profile")
    @classmethod
    def _an_id(cls, v: str | dict[str, Any]) -> str | dict[str, Any]:
        if isinstance(v, str) and not re.fullmatch(ID_PATTERN, v):
            raise ValueError("a stored profile's id, 'sha256:' and 64 lowercase hex digits (POST /profiles answers "
                             "it), or the profile itself as an object")
        return v

    @model_validator(mode="before")
    @classmethod
    def _nothing_the_profile_fixes(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fixed = [name for name in FIXED_BY_PROFILE if name in data]
            if fixed:
                raise PydanticCustomError(FIXED_ERROR, "{expected}", {"fields": ", ".join(fixed), "expected": (
                    f"no {' or '.join(fixed)} beside profile: the profile fixes the model, its input and the "
                    "training recipe (send gpus, batch_size and planner with it)")})
        return data

    def options(self) -> dict[str, Any]:
        """What the answer varies, as JSON: the cards, the batch, the planner fields the caller set."""
        return {"gpus": None if self.gpus is None else self.model_dump(mode="json")["gpus"],
                "batch_size": self.batch_size, "planner": self.planner.model_dump(mode="json", exclude_unset=True)}


def _body_kind(value: Any) -> str:
    """By profile when the body names one, else a request to build the model."""
    has = ("profile" in value) if isinstance(value, dict) else isinstance(value, ProfileEstimateRequest)
    return "ProfileEstimateRequest" if has else "EstimateRequest"


# POST /estimate's body: a request that names a model, or one that names a profile.
EstimateBody = Annotated[
    Annotated[EstimateRequest, Tag("EstimateRequest")]
    | Annotated[ProfileEstimateRequest, Tag("ProfileEstimateRequest")],
    Discriminator(_body_kind),
]


def check_profile(doc: Any, field: str = "profile") -> PortableProfile:
    """The profile ``doc`` holds, by its strict schema (estimator/portable/schema.py) and its request's
    (``SpecError`` naming ``field``'s first bad part)."""
    profile = PortableProfile.from_json(doc, field)
    profile_job(profile, field=field)
    return profile


def profile_job(profile: PortableProfile, gpus: list[Any] | None = None, batch_size: int | None = None,
                planner: dict[str, Any] | None = None, *, field: str = "profile") -> Job:
    """The job of an answer from ``profile``: its request with the cards, the batch and ``planner``'s fields.
    The planner searches nothing the profile does not hold (no suggestions, no seq_len search, unless asked:
    then it says it cannot) and confirms nothing (``confirm`` 'none')."""
    try:
        refuse_paths(profile.request.get("model"), "model")
        parse_request({**profile.request, "gpus": None, "batch_size": None}, allow_local_code=True)
    except SpecError as exc:  # the profile's own request: a bad one is the profile's fault
        raise SpecError(f"{field}.request.{exc.field}", exc.value, exc.expected) from None
    data = {**profile.request, "gpus": gpus, "batch_size": batch_size}
    data["planner"] = {**data.get("planner", {}), "suggestions": False, "max_seq_len": False, **(planner or {}),
                       "confirm": ConfirmMode.NONE.value}
    # never built: a profile's model is only a label (a custom factory's too)
    return job_of(parse_request(data, allow_local_code=True))


def parse_profile_request(data: Any) -> ProfileEstimateRequest:
    """A decoded JSON request by profile (a pod's annotations make one), or a ``SpecError`` naming the field."""
    return validated(ProfileEstimateRequest, data)
