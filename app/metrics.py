"""Prometheus metrics, one registry per app (tests build many apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("batchfit_requests_total", "HTTP requests", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("batchfit_request_seconds", "HTTP request latency", ["route"],
                                 registry=self.registry)
        self.estimate = Histogram("batchfit_estimate_seconds", "estimate time in a worker",
                                  buckets=(0.5, 1, 2, 5, 10, 20, 40, 80, 160, 320), registry=self.registry)
        self.cache_hits = Counter("batchfit_cache_hits_total", "estimates answered from the cache",
                                  registry=self.registry)
        self.cache_misses = Counter("batchfit_cache_misses_total", "estimates computed", registry=self.registry)
        self.cache_errors = Counter("batchfit_cache_errors_total", "cache operations that failed (the estimate "
                                    "was computed without the cache)", ["op"], registry=self.registry)
        for op in ("open", "get", "set", "ping", "decode"):
            self.cache_errors.labels(op)
        self.workers_busy = Gauge("batchfit_workers_busy", "workers running an estimate", registry=self.registry)
        self.worker_restarts = Counter("batchfit_worker_restarts_total", "workers killed at a limit and replaced",
                                       registry=self.registry)
        self.estimates_cancelled = Counter("batchfit_estimates_cancelled_total", "estimates cancelled, queued "
                                           "or running, because every client waiting for them disconnected",
                                           registry=self.registry)

        self.k8s_calls = Counter("batchfit_k8s_calls_total", "Kubernetes calls by verb and outcome: not-opted-in "
                                 "(no batchfit.io/spec or batchfit.io/profile, or a profile not stored), answered, "
                                 "late (an estimate past the deadline: its nodes held, or passed with "
                                 "BATCHFIT_K8S_WHEN_LATE=pass; the estimate goes on for the retry), error (the pod "
                                 "passed)",
                                 ["verb", "outcome"], registry=self.registry)
        self.k8s_late = Counter("batchfit_k8s_late_total", "Kubernetes calls answered at the deadline without an "
                                "estimate that was still running", ["verb"], registry=self.registry)
        self.k8s_estimates = Counter("batchfit_k8s_estimates_total", "estimate jobs started for Kubernetes calls",
                                     registry=self.registry)
        self.k8s_holds = Counter("batchfit_k8s_holds_total", "GPU nodes the filter failed as pending (their card's "
                                 "estimate still running at the deadline, BATCHFIT_K8S_WHEN_LATE=hold), by card",
                                 ["card"], registry=self.registry)
        self.k8s_held = Gauge("batchfit_k8s_held_pods", "pods held now: failed on a card as pending and not yet "
                              "answered for it, by card", ["card"], registry=self.registry)
        self.k8s_hold_wait = Histogram("batchfit_k8s_hold_wait_seconds", "from a pod's first hold on a card to the "
                                       "filter call that answered it for that card", ["card"],
                                       buckets=(1, 2, 5, 10, 20, 40, 80, 160, 320, 640, 1280), registry=self.registry)
        self.k8s_profile_missing = Counter("batchfit_k8s_profile_missing_total", "Kubernetes calls for a pod whose "
                                           "batchfit.io/profile the service does not have (never stored, evicted, or "
                                           "the store down): the pod is treated as not opted in", ["verb"],
                                           registry=self.registry)
        for verb in ("filter", "prioritize", "mutate"):
            self.k8s_late.labels(verb)
            self.k8s_profile_missing.labels(verb)
            for outcome in ("not-opted-in", "answered", "late", "error"):
                self.k8s_calls.labels(verb, outcome)

    def render(self) -> bytes:
        return generate_latest(self.registry)
