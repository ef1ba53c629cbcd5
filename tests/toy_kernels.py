"""Small kernels for the tests: importable by path, so a child process can rebuild their calls."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ejlabel import Invocation, Kernel


@dataclasses.dataclass(frozen=True)
class ScaleConfig:
    factor: int = 1
    mode: str = "mul"


class ScaleKernel(Kernel[ScaleConfig, jax.Array]):
    """x * 2 computed in a way the config chooses; every config gives the same answer."""

    def __init__(self) -> None:
        super().__init__("scale")

    def run(self, x: jax.Array, *, cfg: ScaleConfig, offset: float = 0.0) -> jax.Array:
        if cfg.mode == "mul":
            y = x * 2.0
        else:
            y = x + x
        return jnp.sin(y) * 0 + y + offset

    def heuristic_cfg(self, inv: Invocation) -> ScaleConfig:
        return ScaleConfig()

    def config_space(self, inv: Invocation) -> list[ScaleConfig]:
        return [ScaleConfig(1, "mul"), ScaleConfig(2, "add")]


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    precision: str = "default"


class MatmulKernel(Kernel[MatmulConfig, jax.Array]):
    """A matmul with a hand-written backward, to check custom-VJP labels and gradients."""

    def __init__(self) -> None:
        super().__init__("toymatmul")

    def run(self, a: jax.Array, b: jax.Array, *, cfg: MatmulConfig) -> jax.Array:
        return jnp.dot(a, b)

    def custom_vjp(self, primals: tuple[Any, ...], cfg: MatmulConfig, kwargs: dict[str, Any], cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
        a, b = primals
        (g,) = cotangents
        return (g @ b.T, a.T @ g)

    def heuristic_cfg(self, inv: Invocation) -> MatmulConfig:
        return MatmulConfig()


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """``block`` elements per loop step: fewer, bigger steps do less work per element."""

    block: int = 1
    wrong: bool = False


class LoopSumKernel(Kernel[LoopConfig, jax.Array]):
    """Row sums of ``x [n, m]`` computed by a loop whose trip count the config sets.

    Each loop step does a fixed amount of extra arithmetic, so the number of steps (m / block)
    sets the real cost: block=m is cheapest, block=1 the most expensive. ``wrong=True`` skips
    the loop and returns garbage very fast, which tuning must reject.
    """

    def __init__(self) -> None:
        super().__init__("loopsum")

    def run(self, x: jax.Array, *, cfg: LoopConfig) -> jax.Array:
        n, m = x.shape
        if cfg.wrong:
            return jnp.zeros((n,), x.dtype)
        if m % cfg.block:
            raise ValueError(f"block {cfg.block} does not divide {m}")
        steps = m // cfg.block
        chunks = x.reshape(n, steps, cfg.block)

        probe = x[:, : min(m, 128)]

        def body(i: int, acc: jax.Array) -> jax.Array:
            chunk = lax.dynamic_index_in_dim(chunks, i, axis=1, keepdims=False)
            # A fixed amount of work per step that leaves the result unchanged: cost ~ steps.
            busy = jnp.tanh(probe.T @ probe + i).sum() * 0.0
            return acc + chunk.sum(axis=1) + busy

        return lax.fori_loop(0, steps, body, jnp.zeros((n,), x.dtype))

    def reference(self, x: jax.Array) -> jax.Array:
        return x.sum(axis=1)

    def heuristic_cfg(self, inv: Invocation) -> LoopConfig:
        return LoopConfig(block=1)

    def config_space(self, inv: Invocation) -> list[LoopConfig]:
        m = inv.args[0].shape[1]
        blocks = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if m % b == 0]
        return [LoopConfig(b) for b in blocks] + [LoopConfig(block=m, wrong=True)]


scale = ScaleKernel()
toymatmul = MatmulKernel()
loopsum = LoopSumKernel()


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    """Forward passes are identical; ``broken`` gives a wrong gradient, ``slow`` a costly one."""

    broken: bool = False
    slow: bool = False


class DoubleKernel(Kernel[BackwardConfig, jax.Array]):
    """2 * x with a hand-written backward whose quality the config sets."""

    def __init__(self) -> None:
        super().__init__("double")

    def run(self, x: jax.Array, *, cfg: BackwardConfig) -> jax.Array:
        return 2.0 * x

    def custom_vjp(self, primals: tuple[Any, ...], cfg: BackwardConfig, kwargs: dict[str, Any], cotangents: tuple[Any, ...]) -> tuple[Any, ...]:
        (g,) = cotangents
        grad = 2.0 * g
        if cfg.slow:
            grad = lax.fori_loop(0, 200, lambda i, acc: acc + jnp.tanh(acc) * 0.0, grad)
        return (-grad if cfg.broken else grad,)

    def reference(self, x: jax.Array) -> jax.Array:
        return 2.0 * x

    def heuristic_cfg(self, inv: Invocation) -> BackwardConfig:
        return BackwardConfig(slow=True)

    def config_space(self, inv: Invocation) -> list[BackwardConfig]:
        return [BackwardConfig(slow=True), BackwardConfig(broken=True), BackwardConfig()]


double = DoubleKernel()


@dataclasses.dataclass(frozen=True)
class CostConfig:
    """What a candidate costs: ``steps`` loop steps when it runs (``impl="xla"``: none), and
    ``trace_s`` seconds of sleep while it is traced, which counts as its compile time."""

    impl: str = "loop"
    steps: int = 1
    trace_s: float = 0.0


class CostKernel(Kernel[CostConfig, jax.Array]):
    """x + 1 at a cost the config sets, for tests of the tuner's time budget.

    The heuristic is a slow loop; its declared plain path ``impl="xla"`` (the default
    ``config_for``: ``impl`` replaced) is the plain expression, the fastest; the config space is
    loops that are slow to compile.
    """

    plain_implementation = "xla"

    def __init__(self) -> None:
        super().__init__("cost")

    def run(self, x: jax.Array, *, cfg: CostConfig) -> jax.Array:
        if cfg.trace_s:
            time.sleep(cfg.trace_s)
        if cfg.impl == "xla":
            return x + 1.0
        # Work that leaves the value unchanged (tanh(x) * 0 is not folded for floats).
        return lax.fori_loop(0, cfg.steps, lambda i, acc: acc + jnp.tanh(acc) * 0.0, x) + 1.0

    def reference(self, x: jax.Array) -> jax.Array:
        return x + 1.0

    def heuristic_cfg(self, inv: Invocation) -> CostConfig:
        return CostConfig("loop", steps=300)

    def config_space(self, inv: Invocation) -> list[CostConfig]:
        return [CostConfig("loop", steps=s, trace_s=0.3) for s in (1, 2, 4, 8, 16, 32)]


cost = CostKernel()
