"""batchfit inside Kubernetes: a kube-scheduler extender and a mutating admission webhook.

- ``POST /k8s/filter`` and ``POST /k8s/prioritize`` (app/k8s/extender.py) speak kube-scheduler's extender
  wire format (``k8s.io/kube-scheduler/extender/v1``): they drop the nodes whose GPU cannot hold a pod's
  training step and rank the rest by headroom.
- ``POST /k8s/mutate`` (app/k8s/webhook.py) answers ``AdmissionReview`` (``admission.k8s.io/v1``): it adds the
  batch size, accumulation steps and max batch to the pod's GPU containers' env, and starts the pod's estimate
  on the cluster's cards (app/k8s/cluster.py); for a DRA ResourceClaim or ResourceClaimTemplate, it adds a
  CEL selector on device memory to its GPU requests (app/k8s/claims.py).

A pod opts in with the annotation ``batchfit.io/spec`` (app/k8s/pods.py); a node's GPU comes from NVIDIA GPU
Feature Discovery's labels (app/k8s/cards.py). Answers are kept per card and come back within the caller's
deadline or not at all (app/k8s/answers.py): Kubernetes is never kept waiting for an estimate, a node whose
answer is still being computed is held (resolvable: the scheduler retries the pod; app/k8s/holds.py counts
them), and an error never blocks scheduling. Manifests: deploy/k8s/.
"""
