"""Body of test_rng_routing.py (run in a process of its own: the CPU backend is process-global).

Enumerates torch's random ops from its operator registry (aten ops tagged nondeterministic_seeded),
requires a call below for every Python binding of each (so an op added by a later torch fails
here until it is covered), and checks which generator each call advances: the CUDA stand-in for a
stand-in GPU tensor (or a CUDA device), the CPU default generator for a host tensor; inside and
outside upstream's RNG tracker forks.
"""

import logging
import sys

import torch
import torch.nn.functional as F
from torch import distributions as D

from megatron.cpu import runtime

runtime.activate()
from megatron.core.tensor_parallel.random import CudaRNGStatesTracker  # noqa: E402


def ones(dev, *shape):
    return torch.ones(*shape, device=dev) if dev else torch.ones(*shape)


def probs(dev, *shape):
    return torch.full(shape, 0.5, device=dev) if dev else torch.full(shape, 0.5)


def kw(dev):
    return {"device": dev} if dev else {}


def sdpa(dev):
    q = ones(dev, 1, 2, 4, 8)
    return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)


# (namespace, op name) -> call(dev); dev is "cuda" (a stand-in GPU tensor) or None (a host tensor)
CALLS = {
    ("torch", "alpha_dropout"): lambda d: torch.alpha_dropout(ones(d, 64), 0.5, True),
    ("torch.nn.functional", "alpha_dropout"): lambda d: F.alpha_dropout(ones(d, 64), 0.5, True),
    ("torch", "alpha_dropout_"): lambda d: torch.alpha_dropout_(ones(d, 64), 0.5, True),
    ("torch", "bernoulli"): lambda d: torch.bernoulli(probs(d, 64)),
    ("Tensor", "bernoulli"): lambda d: probs(d, 64).bernoulli(),
    ("Tensor", "bernoulli_"): lambda d: ones(d, 64).bernoulli_(0.5),
    ("torch", "binomial"): lambda d: torch.binomial(ones(d, 64) * 10, probs(d, 64)),
    ("Tensor", "cauchy_"): lambda d: ones(d, 64).cauchy_(),
    ("torch", "dropout"): lambda d: torch.dropout(ones(d, 64), 0.5, True),
    ("torch.nn.functional", "dropout"): lambda d: F.dropout(ones(d, 64), 0.5),
    ("torch", "dropout_"): lambda d: torch.dropout_(ones(d, 64), 0.5, True),
    ("Tensor", "exponential_"): lambda d: ones(d, 64).exponential_(),
    ("torch", "feature_alpha_dropout"): lambda d: torch.feature_alpha_dropout(
        ones(d, 4, 8, 2), 0.5, True
    ),
    ("torch.nn.functional", "feature_alpha_dropout"): lambda d: F.feature_alpha_dropout(
        ones(d, 4, 8, 2), 0.5, True
    ),
    ("torch", "feature_alpha_dropout_"): lambda d: torch.feature_alpha_dropout_(
        ones(d, 4, 8, 2), 0.5, True
    ),
    ("torch", "feature_dropout"): lambda d: torch.feature_dropout(ones(d, 4, 8, 2), 0.5, True),
    ("torch", "feature_dropout_"): lambda d: torch.feature_dropout_(ones(d, 4, 8, 2), 0.5, True),
    ("Tensor", "geometric_"): lambda d: ones(d, 64).geometric_(0.5),
    ("Tensor", "log_normal_"): lambda d: ones(d, 64).log_normal_(),
    ("torch", "multinomial"): lambda d: torch.multinomial(probs(d, 64), 4),
    ("Tensor", "multinomial"): lambda d: probs(d, 64).multinomial(4),
    ("torch", "native_dropout"): lambda d: torch.native_dropout(ones(d, 64), 0.5, True),
    ("torch", "normal"): lambda d: torch.normal(ones(d, 64), ones(d, 64)),
    ("torch.nn.init", "normal"): lambda d: torch.nn.init.normal(ones(d, 8, 8)),
    ("Tensor", "normal_"): lambda d: ones(d, 64).normal_(),
    ("torch.nn.init", "normal_"): lambda d: torch.nn.init.normal_(ones(d, 8, 8)),
    ("torch", "poisson"): lambda d: torch.poisson(ones(d, 64)),
    ("torch", "rand"): lambda d: torch.rand(64, **kw(d)),
    ("torch", "rand_like"): lambda d: torch.rand_like(ones(d, 64)),
    ("torch", "randint"): lambda d: torch.randint(0, 10, (64,), **kw(d)),
    ("torch", "randint_like"): lambda d: torch.randint_like(ones(d, 64), 10),
    ("torch", "randn"): lambda d: torch.randn(64, **kw(d)),
    ("torch", "randn_like"): lambda d: torch.randn_like(ones(d, 64)),
    ("Tensor", "random_"): lambda d: ones(d, 64).random_(),
    ("torch", "randperm"): lambda d: torch.randperm(64, **kw(d)),
    ("torch", "rrelu"): lambda d: torch.rrelu(-ones(d, 64), training=True),
    ("torch.nn.functional", "rrelu"): lambda d: F.rrelu(-ones(d, 64), training=True),
    ("torch", "rrelu_"): lambda d: torch.rrelu_(-ones(d, 64), training=True),
    ("torch.nn.functional", "rrelu_"): lambda d: F.rrelu_(-ones(d, 64), training=True),
    ("torch._C._nn", "rrelu_with_noise"): lambda d: torch._C._nn.rrelu_with_noise(
        -ones(d, 64), ones(d, 64), training=True
    ),
    ("torch._C._nn", "rrelu_with_noise_"): lambda d: torch._C._nn.rrelu_with_noise_(
        -ones(d, 64), ones(d, 64), training=True
    ),
    ("torch.nn.functional", "scaled_dot_product_attention"): sdpa,
    (
        "torch._C._nn",
        "scaled_dot_product_attention",
    ): lambda d: torch._C._nn.scaled_dot_product_attention(
        *[ones(d, 1, 2, 4, 8)] * 3, dropout_p=0.5
    ),
    ("torch.nn.init", "uniform"): lambda d: torch.nn.init.uniform(ones(d, 8, 8)),
    ("Tensor", "uniform_"): lambda d: ones(d, 64).uniform_(),
    ("torch.nn.init", "uniform_"): lambda d: torch.nn.init.uniform_(ones(d, 8, 8)),
}
#: Bindings not called here, and why. Membership in random_callables() is still required.
NOT_CALLED = {
    "gru": "needs a weight list",
    "lstm": "needs a weight list",
    "rnn_relu": "needs a weight list",
    "rnn_tanh": "needs a weight list",
    "miopen_rnn": "ROCm only",
}
# Python wrappers that call seeded ops inside (found by runtime.random_callables()); one call each.
WRAPPERS = {
    "torch.nn.functional.dropout1d": lambda d: F.dropout1d(ones(d, 4, 8), 0.5),
    "torch.nn.functional.dropout2d": lambda d: F.dropout2d(ones(d, 4, 8, 2), 0.5),
    "torch.nn.functional.dropout3d": lambda d: F.dropout3d(ones(d, 4, 8, 2, 2), 0.5),
    "torch.nn.functional.gumbel_softmax": lambda d: F.gumbel_softmax(ones(d, 4, 8)),
    "torch.nn.functional.fractional_max_pool2d": lambda d: F.fractional_max_pool2d(
        ones(d, 1, 1, 8, 8), 2, output_size=4
    ),
    "torch.nn.functional.fractional_max_pool2d_with_indices": (
        lambda d: F.fractional_max_pool2d_with_indices(ones(d, 1, 1, 8, 8), 2, output_size=4)
    ),
    "torch.nn.functional.fractional_max_pool3d": lambda d: F.fractional_max_pool3d(
        ones(d, 1, 1, 8, 8, 8), 2, output_size=4
    ),
    "torch.nn.functional.fractional_max_pool3d_with_indices": (
        lambda d: F.fractional_max_pool3d_with_indices(ones(d, 1, 1, 8, 8, 8), 2, output_size=4)
    ),
    "torch.nn.functional.rrelu_with_noise": None,
    "torch.nn.functional.rrelu_with_noise_": None,
    "torch.nn.functional.multi_head_attention_forward": lambda d: F.multi_head_attention_forward(
        ones(d, 3, 1, 8),
        ones(d, 3, 1, 8),
        ones(d, 3, 1, 8),
        8,
        2,
        ones(d, 24, 8),
        ones(d, 24),
        None,
        None,
        False,
        0.5,
        ones(d, 8, 8),
        ones(d, 8),
        training=True,
    ),
    "torch.nn.init.kaiming_normal_": lambda d: torch.nn.init.kaiming_normal_(ones(d, 8, 8)),
    "torch.nn.init.kaiming_uniform_": lambda d: torch.nn.init.kaiming_uniform_(ones(d, 8, 8)),
    "torch.nn.init.xavier_normal_": lambda d: torch.nn.init.xavier_normal_(ones(d, 8, 8)),
    "torch.nn.init.xavier_uniform_": lambda d: torch.nn.init.xavier_uniform_(ones(d, 8, 8)),
    "torch.nn.init.trunc_normal_": lambda d: torch.nn.init.trunc_normal_(ones(d, 8, 8)),
    "torch.nn.init.orthogonal_": lambda d: torch.nn.init.orthogonal_(ones(d, 8, 8)),
    "torch.nn.init.sparse_": lambda d: torch.nn.init.sparse_(ones(d, 8, 8), 0.5),
}
#: Calls that draw on the host on a GPU too: nn.init.sparse_ takes its permutations from
#: torch.randperm(rows) without a device, i.e. from the CPU generator (its normal_ is on the GPU).
ALSO_HOST = {"torch.nn.init.sparse_"}
DISTRIBUTIONS = {
    "Normal": lambda d: D.Normal(ones(d, 8), ones(d, 8)).rsample(),
    "Uniform": lambda d: D.Uniform(ones(d, 8) * 0.9, ones(d, 8) * 1.1).rsample((3,)),
    "Gamma": lambda d: D.Gamma(ones(d, 8), ones(d, 8)).rsample(),
    "Beta": lambda d: D.Beta(ones(d, 8), ones(d, 8)).rsample(),
    "Dirichlet": lambda d: D.Dirichlet(ones(d, 8)).rsample(),
    "Bernoulli": lambda d: D.Bernoulli(probs(d, 8)).sample(),
    "Categorical": lambda d: D.Categorical(probs(d, 8)).sample((4,)),
    "Poisson": lambda d: D.Poisson(ones(d, 8)).sample(),
    "Binomial": lambda d: D.Binomial(10, probs(d, 8)).sample(),
    "Exponential": lambda d: D.Exponential(ones(d, 8)).rsample(),
    "Cauchy": lambda d: D.Cauchy(ones(d, 8), ones(d, 8)).rsample(),
    "LogNormal": lambda d: D.LogNormal(ones(d, 8), ones(d, 8)).rsample(),
    "Laplace": lambda d: D.Laplace(ones(d, 8), ones(d, 8)).rsample(),
    "Gumbel": lambda d: D.Gumbel(ones(d, 8), ones(d, 8)).rsample(),
    "Geometric": lambda d: D.Geometric(probs(d, 8)).sample(),
    "Multinomial": lambda d: D.Multinomial(5, probs(d, 8)).sample(),
    "StudentT": lambda d: D.StudentT(ones(d, 8)).rsample(),
}

NS = {ns.__name__: ns for ns in runtime.BINDING_NAMESPACES}
NS["Tensor"] = torch.Tensor
failures = []
randoms = runtime.random_callables()

# 1. enumeration: every binding of every seeded op is routed and has a call (or a reason)
for name in sorted(runtime.seeded_aten_ops()):
    for ns_name, ns in NS.items():
        f = getattr(ns, name, None)
        if not callable(f) or (name.startswith("_") and (ns_name, name) not in CALLS):
            continue
        if f not in randoms:
            failures.append(f"{ns_name}.{name}: not in runtime.random_callables()")
        if (ns_name, name) not in CALLS and name not in NOT_CALLED:
            failures.append(f"{ns_name}.{name}: seeded op with no call in this test (add one)")
for f in randoms:
    mod = getattr(f, "__module__", "") or ""
    full = f"{mod}.{f.__name__}"
    if (
        mod in ("torch.nn.functional", "torch.nn.init")
        and not f.__name__.startswith("_")
        and (mod, f.__name__) not in CALLS
        and full not in WRAPPERS
        and not (
            mod == "torch.nn.init"
            and f.__name__
            in (
                "normal",
                "uniform",
                "xavier_uniform",
                "xavier_normal",
                "kaiming_uniform",
                "kaiming_normal",
                "sparse",
                "orthogonal",
            )
        )
    ):
        if f.__name__ not in {n for (_, n) in CALLS}:
            failures.append(f"{full}: random wrapper with no call in this test (add one)")


# 2. which generator each call advances
class Warned(logging.Handler):
    def __init__(self):
        super().__init__()
        self.count = 0

    def emit(self, record):
        if "CPU RNG state changed within GPU RNG context" in record.getMessage():
            self.count += 1


warned = Warned()
logging.getLogger("megatron.core.tensor_parallel.random").addHandler(warned)
tracker = CudaRNGStatesTracker()
tracker.add("stream", 99)


def advanced(call, dev, in_fork):
    torch.manual_seed(1)
    torch.cuda.manual_seed(2)
    cpu0, gpu0, trk0 = (
        torch.get_rng_state(),
        torch.cuda.get_rng_state(),
        tracker.get_states()["stream"].clone(),
    )
    if in_fork:
        with tracker.fork("stream"):
            call(dev)
    else:
        call(dev)
    return (
        not torch.equal(cpu0, torch.get_rng_state()),
        not torch.equal(gpu0, torch.cuda.get_rng_state()),
        not torch.equal(trk0, tracker.get_states()["stream"]),
    )


calls = {f"{a}.{b}": c for (a, b), c in CALLS.items()}
calls.update({k: v for k, v in WRAPPERS.items() if v is not None})
calls.update({f"torch.distributions.{k}": v for k, v in DISTRIBUTIONS.items()})
checked = 0
for label, call in sorted(calls.items()):
    for in_fork in (False, True):
        warned_before = warned.count
        cpu, gpu, trk = advanced(call, "cuda", in_fork)
        want = (False, not in_fork, in_fork)
        if label in ALSO_HOST:
            want = (True, not in_fork, in_fork)
        if (cpu, gpu, trk) != want:
            failures.append(
                f"{label} on a GPU tensor{' in a fork' if in_fork else ''}: advanced "
                f"cpu={cpu} cuda={gpu} tracker={trk}, expected cpu=False "
                f"cuda={not in_fork} tracker={in_fork}"
            )
        if in_fork and warned.count != warned_before and label not in ALSO_HOST:
            failures.append(f"{label}: upstream warned about a CPU draw inside a GPU RNG fork")
        cpu, gpu, trk = advanced(call, None, in_fork)
        if (cpu, gpu, trk) != (True, False, False):
            failures.append(
                f"{label} on a host tensor: advanced cpu={cpu} cuda={gpu} tracker={trk}, "
                "expected the CPU generator only"
            )
        checked += 1

# 3. guard: upstream's fork check does see a CPU draw (so the absence of warnings above means
# something)
before = warned.count
with tracker.fork("stream"):
    torch.ones(4).normal_()
if warned.count != before + 1:
    failures.append("guard: a host draw inside a fork did not trigger upstream's warning")

if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"OK {checked} calls")
