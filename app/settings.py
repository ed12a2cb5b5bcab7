"""Service settings, from the environment (prefix ``BATCHFIT_``) or defaults.

>>> Settings(workers=1).request_timeout_s
600.0

Tests override ``get_settings`` (FastAPI dependency) or pass a ``Settings``
to ``create_app``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from estimator.gpus import find_gpu


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BATCHFIT_", extra="ignore")

    workers: int = Field(2, ge=1, le=64, description="estimate worker processes")
    queue_size: int = Field(16, ge=0, le=10_000, description="requests that may wait for a worker")
    request_timeout_s: float = Field(600.0, gt=0, description="a running estimate is killed after this "
                                     "(planner.confirm='every-card' on the whole catalog takes minutes on 2 cores)")
    worker_memory_bytes: int = Field(8 * 2**30, ge=2**28, description="a worker over this RSS is killed")
    cache_path: str = Field(".batchfit-cache.sqlite", description="SQLite result cache ('' disables)")
    redis_url: str | None = Field(None, description="use Redis for the cache instead of SQLite")
    cache_ttl_s: int = Field(7 * 24 * 3600, ge=0, description="cached answers expire after this (7 days); 0: never")
    cache_retry_s: float = Field(5.0, ge=0, description="a degraded cache (a broken file, Redis down) is "
                                 "tried again at most this often")
    max_profile_bytes: int = Field(16 * 2**20, ge=1024, le=2**30, description="POST /profiles: a larger profile "
                                   "gets 413, unread (a resnet50 profile is 0.3 MiB)")
    profile_budget_count: int = Field(10_000, ge=1, description="stored profiles kept; past it the oldest stored "
                                      "are evicted")
    profile_budget_bytes: int = Field(2**31, ge=1024, description="bytes of stored profiles kept; past it the "
                                      "oldest stored are evicted")
    api_keys: str = Field("", description="comma-separated keys; empty: no auth")
    retry_after_s: int = Field(5, ge=1, description="Retry-After when the queue is full")
    max_body_bytes: int = Field(2**20, ge=1024, le=2**30, description="larger request bodies get 413, unread")
    k8s_max_body_bytes: int = Field(64 * 2**20, ge=1024, le=2**30, description="the /k8s/ routes' body limit: "
                                    "kube-scheduler sends every candidate node's object to the extender")
    k8s_deadline_s: float = Field(4.0, gt=0, le=30, description="the /k8s/ routes answer within this: from the "
                                  "cache, or from an estimate done by then (else it goes on in the background); "
                                  "under kube-scheduler's extender httpTimeout and the webhook's timeoutSeconds (5 s)")
    webhook_deny_unfit: bool = Field(False, description="POST /k8s/mutate denies a pod whose job does not fit its "
                                     "pinned card even at batch 1 (else it is allowed, with a warning)")
    k8s_when_late: Literal["hold", "pass"] = Field("hold", description="a GPU node whose card has no answer by "
                                                  "the deadline: 'hold' fails it as resolvable (FailedNodes: "
                                                  "kube-scheduler retries the pod), 'pass' passes it as if it fit")
    k8s_cards: str = Field("", description="comma-separated cards the cluster has (catalog names or GFD product "
                           "labels): the webhook starts a pod's estimate on them, and on the cards the extender saw")
    k8s_without_key: bool = Field(False, description="the /k8s/ routes need no API key even when keys are set "
                                  "(kube-scheduler's extender cannot send one: restrict them by network policy)")

    @field_validator("api_keys")
    @classmethod
    def _no_empty_key(cls, v: str) -> str:
        """Keys set but empty (" , ") would turn auth off silently: a startup error instead."""
        if v.strip() and any(not k.strip() for k in v.split(",")):
            raise ValueError("BATCHFIT_API_KEYS: every comma-separated key must be non-empty")
        return v

    @field_validator("k8s_cards")
    @classmethod
    def _known_cards(cls, v: str) -> str:
        """A card the catalog does not know would never be estimated: a startup error naming it."""
        unknown = [n.strip() for n in v.split(",") if n.strip() and find_gpu(n.strip()) is None]
        if unknown:
            raise ValueError(f"BATCHFIT_K8S_CARDS: {', '.join(map(repr, unknown))} is not a card batchfit knows "
                             "(expected catalog names or GFD nvidia.com/gpu.product labels, see GET /gpus)")
        return v

    def card_names(self) -> list[str]:
        """``k8s_cards`` as a list: ``"Tesla-T4, A100-80GB"`` -> ``["Tesla-T4", "A100-80GB"]``."""
        return [n.strip() for n in self.k8s_cards.split(",") if n.strip()]

    def keys(self) -> list[str]:
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
