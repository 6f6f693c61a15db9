"""Errors that several layers raise (this module imports nothing of omnigen's)."""

from __future__ import annotations


class InputError(ValueError, TypeError):
    """Every problem found in one call's arguments (`problems`), reported in one message.

    Both a ValueError and a TypeError, so code that catches either kind of bad argument catches it. Made as
    `InputError(problems)`: the list is the exception's one argument and the message is formatted when shown, with
    no `__init__` of its own, so that TorchDynamo can trace the raise inside a compiled function and shows the
    problems (an `__init__` calling `super().__init__` made it report its own tracing failure instead)."""

    @property
    def problems(self) -> list[str]:
        found = self.args[0] if self.args else []
        return [found] if isinstance(found, str) else list(found)

    def __str__(self) -> str:
        problems = self.problems
        if len(problems) == 1:
            return problems[0]
        return f"{len(problems)} problems with these arguments: " + "; ".join(
            f"({i}) {text}" for i, text in enumerate(problems, 1))


def exception_line(exc: BaseException, limit: int | None = None) -> str:
    """`RuntimeError: the first line of its message` (at most `limit` characters of it): an exception named in a
    sentence of ours, a warning or a skipped peer's reason."""
    lines = str(exc).strip().splitlines()
    first = lines[0][:limit] if lines else "no message"
    return f"{type(exc).__name__}: {first}"


def type_name(value: object) -> str:
    """`numpy.ndarray`, `list`, `str`: a value's type as a user would write it."""
    kind = type(value)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__.split('.')[0]}.{kind.__name__}"


def tensor_problem(name: str, value: object, device: str = "cuda") -> str | None:
    """The problem with `value` as a 4-D torch tensor argument, or None."""
    import torch

    if not isinstance(value, torch.Tensor):
        fix = (f"torch.from_numpy({name})" if type(value).__module__ == "numpy" else f"torch.as_tensor({name})")
        if device == "cuda":
            fix += ".to('cuda', torch.bfloat16)"
        return (f"{name} must be a torch.Tensor [B, H, S, D]{' on a CUDA device' if device == 'cuda' else ''}, "
                f"not {type_name(value)} (convert it with {fix})")
    if value.dim() != 4:
        return f"{name} must have 4 dimensions [B, H, S, D] (SDPA layout), got shape {tuple(value.shape)}"
    return None


def cuda_problem() -> str | None:
    """Why CUDA cannot be used in this process (one clause, with the fix), or None when it can.
    Remembered once CUDA is usable (plan() asks on every call, on a GPU training step's host path)."""
    global _CUDA_OK
    if _CUDA_OK:
        return None
    problem = _cuda_problem()
    _CUDA_OK = problem is None
    return problem


_CUDA_OK = False


def _cuda_problem() -> str | None:
    import torch

    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build of torch "
                "(https://pytorch.org/get-started/locally/) to use a GPU")
    try:
        if torch.cuda.is_available():
            return None
    except Exception as exc:  # pragma: no cover - broken driver installs
        return f"CUDA does not initialise ({str(exc).splitlines()[0]}); check the driver with nvidia-smi"
    return ("no CUDA GPU is visible: no NVIDIA driver was found or CUDA_VISIBLE_DEVICES hides every GPU "
            "(check with nvidia-smi)")
