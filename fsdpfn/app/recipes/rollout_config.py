"""The ``rollout:`` section of the RL recipes (RolloutConfig): which rollout servers a run talks
to or starts, how weights reach them, how they sample; and the GPU-list helpers it shares with
``launch:``. Re-exported by fsdpfn.app.recipes.config."""

from __future__ import annotations

import attrs

from fsdpfn.errors import ConfigError
from fsdpfn.validators import (boolean, fail, integer, is_nonempty_str, is_port, number, one_of,
                               satisfies, temperature_rule, to_float)
from fsdpfn.wire.http import is_http_url

__all__ = ["RolloutConfig", "PushSection", "PUSH_OWNED", "SERVER_OWNED", "SAMPLING_OWNED"]

_opt_str = satisfies("must be null or a non-empty string", is_nonempty_str, optional=True)

# PushConfig fields the recipe sets itself -> where the YAML sets them
PUSH_OWNED = {
    "transport": "rollout.transport",
    "disk_root": "the recipe (run_dir/push with rollout.transport: disk)",
    "pause_generation": "rollout.max_staleness (0: generation paused around each push; >= 1: "
                        "requests go on across it)",
    "on_bucket": "the recipe (a callback)",
}


@attrs.frozen
class PushSection:
    """How each step's weights reach the servers (``rollout.push``): fsdpfn.PushConfig's
    options, less those the recipe sets itself (PUSH_OWNED)."""

    # the dtype sent (null: the servers' served dtype)
    dtype: str | None = attrs.field(default=None, validator=one_of(
        None, "bfloat16", "float16", "float32", rule="must be null, 'bfloat16', 'float16' or "
        "'float32'"))
    # the size of the middle buckets of a push
    bucket_bytes: int = attrs.field(default=1 << 30, validator=integer(1))
    # the size of its first and last buckets (null: every bucket bucket_bytes)
    edge_bucket_bytes: int | None = attrs.field(default=256 << 20,
                                                validator=integer(1, allow=(None,)))
    # gloo or nccl (null: nccl when the trainer and every server are on CUDA)
    backend: str | None = attrs.field(default=None, validator=one_of(None, "gloo", "nccl"))
    # bound on every request and bucket of a push (a generation request's: rollout.timeout_s)
    timeout_s: float = attrs.field(default=300.0, converter=to_float, validator=number(gt=0))
    # bound on setting up the update group with the servers
    init_timeout_s: float = attrs.field(default=120.0, converter=to_float,
                                        validator=number(gt=0))
    # the servers drop their KV cache with each update
    flush_cache: bool = attrs.field(default=True, validator=boolean)
    # names, shapes and the model's config compared with each server's before a byte is sent
    precheck: bool = attrs.field(default=True, validator=boolean)
    # the pushed versions kept under run_dir/push (rollout.transport: disk)
    keep_last: int = attrs.field(default=2, validator=integer(1))
    # where the servers reach trainer rank 0 (null: 127.0.0.1 for local servers, else the
    # address of the interface that routes to the first server)
    master_address: str | None = attrs.field(default=None, validator=_opt_str)
    # its port (null or 0: a free one)
    master_port: int | None = attrs.field(default=None, validator=satisfies(
        "must be null or a port in 0..65535 (0: a free one)", is_port, optional=True))
    # the update group's name (null: a fresh one per run)
    group_name: str | None = attrs.field(default=None, validator=_opt_str)
    # SGLang servers: their /pause_generation mode around an update
    pause_mode: str = attrs.field(default="abort", validator=one_of("abort", "retract",
                                                                    "in_place"))
    # SGLang servers: the largest gap of their greedy log-probs to the trainer's after a push
    # (null: 1e-3 for a float32 push, 0.1 for 16-bit dtypes)
    probe_tol: float | None = attrs.field(default=None, validator=number(ge=0, optional=True))


PushSection.__fsdpfn_moved__ = {k: f"set by {v}" for k, v in PUSH_OWNED.items()}


def as_gpus(value):
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, str):
        value = [int(v) if v.isdecimal() else v for v in value.replace(" ", "").split(",") if v]
    return tuple(value) if isinstance(value, list) else value


def _distinct_indices(value) -> bool:
    return isinstance(value, tuple) and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value) \
        and len(set(value)) == len(value)


gpu_list = satisfies("must be null or a list of distinct GPU indices >= 0", _distinct_indices,
                     optional=True,
                     show=lambda v: repr(list(v) if isinstance(v, tuple) else v))


def _urls(value):
    """rollout.url as one string: a list of URLs (YAML) is kept comma-separated, each stripped
    of spaces and a trailing slash; anything else is left to the validator."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        value = ",".join(value)
    if isinstance(value, str):
        return ",".join(v.strip().rstrip("/") for v in value.split(","))
    return list(value) if isinstance(value, tuple) else value


def _server_args(value):
    """rollout.server_args as a tuple of strings: a YAML list (numbers written as text:
    ``[--decode-rows, 64]``), or one string (``--decode hf``) split as a shell would; anything
    else is left to the validator."""
    import shlex

    if value is None:
        return ()
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # fsdpfn.serde reads one string as a list of one
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError:  # an unclosed quote: the validator names it
            return value
    if isinstance(value, (list, tuple)):
        return tuple(str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
                     for v in value)
    return value


# flags of python -m fsdpfn.rollout that fsdpfn run sets itself -> the key that sets them
SERVER_OWNED = {
    "--model": "model.path (the run's starting model)", "--port": "fsdpfn run (a free port)",
    "--host": "fsdpfn run (127.0.0.1)", "--dtype": "engine.dtype",
    "--device": "rollout.device and rollout.gpus", "--threads": "rollout.threads",
    "--load-format": "model.random_init", "--wait-for-model": "rollout.health_timeout_s",
    "--parent-pid": "fsdpfn run (the launcher's pid)",
    "--weight-version": "fsdpfn run (the trainer's pushes)",
    "--no-channel": "fsdpfn run (the trainer pushes over the channel)",
    "--channel-port": "fsdpfn run (a free port)",
    "--fd": "fsdpfn run (the port's socket, bound by the launcher)"}


def server_namespace(args, error=None):
    """The server's parsed command line with these flags (fsdpfn run's own as placeholders),
    flags written out in full; ``error`` is called with argparse's message instead of exiting."""
    from fsdpfn.rollout.args import parse_strict

    return parse_strict(["--model", "m", "--port", "0", *args], error)


def _check_server_args(instance, attribute, value) -> None:
    """Each flag must be one python -m fsdpfn.rollout accepts, with a valid value, and not one
    fsdpfn run sets itself; with rollout.url (external servers) there is no server to pass
    them to."""
    name = attribute.name
    if isinstance(value, str):
        fail(name, "must be a list of flags, or one string a shell can split (quotes closed)",
             value)
    if not isinstance(value, tuple) or not all(is_nonempty_str(v) for v in value):
        fail(name, "must be a list of flags of python -m fsdpfn.rollout (non-empty strings)",
             value)
    shown = repr(list(value))
    for v in value:
        flag = v.split("=", 1)[0]
        if flag in SERVER_OWNED:
            fail(name, f"must not set {flag}, which comes from {SERVER_OWNED[flag]}", value,
                 shown=shown)
    def refuse(message: str):
        fail(name, "must be flags python -m fsdpfn.rollout accepts", value,
             shown=f"{shown} ({message})")

    server_namespace(value, refuse)
    if instance is not None and value and instance.url is not None:
        fail(name, "must be empty when rollout.url names external servers (the flags go to the "
             "servers fsdpfn run starts)", value, shown=shown)


# sampling parameters a recipe sets itself -> the key that sets them
SAMPLING_OWNED = {"temperature": "rollout.temperature", "top_p": "rollout.top_p",
                  "n": "advantage.group_size", "seed": "seed", "sampling_seed": "seed",
                  "max_new_tokens": "data.max_response_tokens (task.max_answer_tokens for the "
                                    "built-in task)"}


def _workflow_only(instance, attribute, value) -> None:
    """A workflow's own bound: refused without rollout.workflow (never silently unused)."""
    default = attribute.default
    if value != default and instance.workflow is None:
        fail(attribute.name, "applies to rollout.workflow's episodes only, and no workflow is "
             "set", value)


def _check_sampling(instance, attribute, value) -> None:
    """Sampling parameters the server accepts (fsdpfn.rollout.SamplingParams' own rules), none
    of them one the recipe sets itself."""
    import difflib

    from fsdpfn.rollout.errors import UpdateError
    from fsdpfn.rollout.sampling import INERT, REFUSED, SamplingParams

    name = attribute.name
    if not isinstance(value, dict) or not all(is_nonempty_str(k) for k in value):
        fail(name, "must be a mapping of sampling parameters (fsdpfn.rollout.SamplingParams)",
             value)
    for key, v in value.items():
        if key in SAMPLING_OWNED:
            fail(f"{name}.{key}", f"must not be set here: it comes from {SAMPLING_OWNED[key]}",
                 v)
    allowed = sorted(set(SamplingParams.FIELDS) - set(SAMPLING_OWNED))
    unknown = sorted(set(value) - set(SamplingParams.FIELDS) - set(REFUSED) - set(INERT))
    if unknown:
        close = difflib.get_close_matches(unknown[0], allowed, n=1)
        raise ConfigError(f"{name}: unknown key(s) {unknown}"
                          + (f"; did you mean {close[0]!r}?" if close else "")
                          + f" (allowed: {', '.join(allowed)})")
    try:
        SamplingParams(**value)
    except UpdateError as exc:  # "sampling_params.top_k: must be ..., got ..."
        raise ConfigError(name + str(exc).removeprefix("sampling_params")) from None
    if instance is not None and value and instance.workflow is not None:
        fail(name, "must be empty with rollout.workflow (the workflow's own calls choose their "
             "sampling)", value)


@attrs.frozen
class RolloutConfig:
    """The rollout server. ``url=None``: ``fsdpfn run`` starts ``python -m fsdpfn.rollout`` on
    the run's initial model and stops it at the end; else the trainer uses the server at ``url``
    (it must serve a model of the same architecture). Weights are pushed after every step over
    ``transport`` ("broadcast": a gloo/NCCL group; "ipc": CUDA IPC handles, for a server on
    trainer rank 0's GPU; "disk": safetensors under run_dir/push; "auto": broadcast, or ipc
    when trainer and server share a GPU, where NCCL cannot connect two processes). ``device:
    auto`` follows the trainer; ``gpus``: the servers' GPUs, one server per GPU listed (null:
    the host's last ``servers`` GPUs; the trainer takes the GPUs no server uses).

    Several servers: ``gpus: [4, 5, 6, 7]`` starts four (the 8-GPU shape of 4 trainer GPUs and
    4 serving), ``servers: N`` starts N (on the CPU, or on the host's last N GPUs; default
    len(gpus), or 1), and ``url`` may list external servers (a YAML list, or comma-separated).
    Each group of answers goes to one server, the least loaded (fsdpfn.rollout.balance), and
    every push reaches all of them through one update group (their versions and checksums must
    agree). Several servers need GPUs of their own: none may be a trainer GPU (so ``transport:
    ipc``, which shares rank 0's GPU, is for one server). ``gpus`` places servers that fsdpfn
    run starts on CUDA; where it cannot apply (``device: cpu``, ``url``, a host without GPUs)
    it is refused before launch, never ignored.

    ``max_staleness``: 0 is the synchronous loop (generate, then train, then push); N >= 1 lets
    generation run up to N steps ahead of training (fsdpfn.rollout.stream: no trained sample is
    more than N weight versions old, nothing is thrown away; pushes then land without pausing
    generation). ``workflow``: "pkg.module:function" or "path.py:function", called once per
    sample with an openai client and the data row, returning the episode's reward
    (fsdpfn.app.recipes.workflow), each call bounded by ``workflow_timeout_s``; an episode's row
    longer than ``max_episode_tokens`` (null: the model's max_position_embeddings) is dropped
    and counted. ``push``: how the weights travel (PushSection: fsdpfn.PushConfig's options less
    those the recipe owns; ``push.timeout_s`` bounds a push, ``timeout_s`` a generation
    request)."""

    url: str | None = attrs.field(default=None, converter=_urls)
    # how many built-in servers fsdpfn run starts (null: one per rollout.gpus entry, else 1);
    # at most one per answer a step asks for (prompts_per_step x advantage.group_size)
    servers: int | None = attrs.field(default=None, validator=integer(1, allow=(None,)))
    transport: str = attrs.field(default="auto",
                                 validator=one_of("auto", "broadcast", "ipc", "disk"))
    threads: int = attrs.field(default=1, validator=integer(1))
    device: str = attrs.field(default="auto", validator=one_of("auto", "cpu", "cuda"))
    # the servers' GPUs, one server each (null: the host's last `servers` GPUs); for servers
    # fsdpfn run starts on CUDA: refused with device cpu, with url and on a host without GPUs
    gpus: tuple[int, ...] | None = attrs.field(default=None, converter=as_gpus,
                                               validator=gpu_list)
    temperature: float = attrs.field(default=1.0, converter=to_float, validator=temperature_rule)
    top_p: float = attrs.field(default=1.0, converter=to_float, validator=number(gt=0, le=1))
    timeout_s: float = attrs.field(default=120.0, converter=to_float, validator=number(gt=0))
    # how long the servers fsdpfn run starts may take to answer /health, and how long the
    # trainer waits for the external servers of url to answer it (one bound for all of them)
    health_timeout_s: float = attrs.field(default=300.0, converter=to_float,
                                          validator=number(gt=0))
    max_staleness: int = attrs.field(default=0, validator=integer(0))
    workflow: str | None = attrs.field(default=None, validator=_opt_str)
    workflow_timeout_s: float = attrs.field(default=600.0, converter=to_float,
                                            validator=[number(gt=0), _workflow_only])
    max_episode_tokens: int | None = attrs.field(
        default=None, validator=[integer(1, allow=(None,)), _workflow_only])
    # flags added to each rollout server fsdpfn run starts (`python -m fsdpfn.rollout --help`):
    # the decode loop's kernels, rows and lengths, HF generate (--decode hf), CUDA graphs;
    # checked before launch, and a flag fsdpfn run sets itself is refused naming its key
    server_args: tuple[str, ...] = attrs.field(default=(), converter=_server_args,
                                               validator=_check_server_args)
    # more sampling parameters for every generation request (fsdpfn.rollout.SamplingParams:
    # top_k, min_p, stop, stop_token_ids, the penalties, ...), checked before launch; the
    # held-out eval (greedy) takes those that decide where an answer ends. The decode loop
    # serves top_k and stops; min_p, min_new_tokens and the penalties need HF generate
    # (server_args: [--decode, hf] on a GPU). A workflow's calls choose their own
    sampling: dict = attrs.field(factory=dict, validator=_check_sampling)
    # how each step's weights reach the servers: fsdpfn.PushConfig less what the recipe owns
    push: PushSection = attrs.field(factory=PushSection)

    @url.validator
    def _check_url(self, attribute, value):
        if value is None:
            return
        if not is_nonempty_str(value):
            fail("url", "must be None, 'http://host:port' or a list of them", value)
        urls = value.split(",")
        for u in urls:
            if not is_http_url(u):
                fail("url", "must name each server as 'http://host:port'", u,
                     shown=repr(u) + (f" in {urls}" if len(urls) > 1 else ""))
        twice = [u for u in urls if urls.count(u) > 1]
        if twice:
            fail("url", "must name each server once", urls, shown=f"{twice[0]!r} twice in {urls}")

    def __attrs_post_init__(self):
        self._check_external()
        if self.gpus is not None and self.device == "cpu":
            fail("gpus", "must be null with rollout.device 'cpu' (GPU indices place servers on "
                         "CUDA; rollout.servers=N starts N on the CPU)", self.gpus,
                 shown=repr(list(self.gpus)))
        if self.servers is not None and self.gpus is not None \
                and self.servers != len(self.gpus):
            fail("servers", f"must equal the number of rollout.gpus (one server per GPU listed: "
                            f"{list(self.gpus)})", self.servers)
        if self.url is not None and self.servers is not None and self.servers != len(self.urls):
            fail("servers", f"must equal the number of servers rollout.url lists "
                            f"({len(self.urls)}; fsdpfn run starts none then)", self.servers)

    def _check_external(self) -> None:
        """With url (external servers) nothing is placed: gpus cannot apply, and ipc, which
        hands CUDA memory to a server fsdpfn run starts on trainer rank 0's GPU, cannot
        either."""
        if self.url is None:
            return
        if self.gpus is not None:
            fail("gpus", "must be null when rollout.url names external servers (fsdpfn run "
                         "starts no server to place)", self.gpus, shown=repr(list(self.gpus)))
        if self.transport == "ipc":
            fail("transport", "must not be 'ipc' when rollout.url names external servers (ipc "
                              "hands CUDA memory of trainer rank 0's GPU to a server fsdpfn run "
                              "starts on that GPU); use auto, broadcast or disk", self.transport)

    @property
    def urls(self) -> tuple[str, ...]:
        """The external servers' URLs (empty: fsdpfn run starts its own)."""
        return tuple(self.url.split(",")) if self.url else ()

    @property
    def n_servers(self) -> int:
        """How many servers the run talks to: the URLs listed, else ``servers``, else one per
        GPU in ``gpus``, else 1."""
        if self.url:
            return len(self.urls)
        return self.servers or (len(self.gpus) if self.gpus else 1)
