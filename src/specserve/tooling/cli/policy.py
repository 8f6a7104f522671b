"""`specserve policy`: the per-class speculation policies, through a router's PolicyAdmin."""

from __future__ import annotations

from pathlib import Path

import typer

from specserve.tooling.cli.app import RUN_DIR, app, router_address, router_channel

policy_app = typer.Typer(no_args_is_help=True, help="Per workload class speculation policies (PolicyAdmin).")
app.add_typer(policy_app, name="policy")
_ROUTER_OPT = typer.Option(None, "--router", help="Router host:port (default: the local stack).")
_TOKEN_OPT = typer.Option(None, "--token", envvar="SPECSERVE_ADMIN_TOKEN",
                          help="Admin token (or SPECSERVE_ADMIN_TOKEN).")


def _admin_token(token: str | None, router: str | None, run_dir: Path) -> str:
    """The given token, else (for the local stack, i.e. no --router) the one `up` wrote."""
    if not token and router is None and (run_dir / "admin.token").exists():
        token = (run_dir / "admin.token").read_text().strip()
    return token or ""


def _admin(router: str | None, token: str | None, run_dir: Path = RUN_DIR, stub=None):
    """A stub of the router's admin service (PolicyAdmin, or `stub`'s) and the token's metadata."""
    from specserve.v1 import policy_pb2_grpc

    token = _admin_token(token, router, run_dir)
    if not token:
        raise typer.BadParameter("an admin token is needed: --token or SPECSERVE_ADMIN_TOKEN")
    channel = router_channel(router_address(router, run_dir), run_dir)
    return (stub or policy_pb2_grpc.PolicyAdminStub)(channel), [("authorization", f"Bearer {token}")]


def _call(fn, request, metadata):
    import grpc

    try:
        return fn(request, metadata=metadata, timeout=30)
    except grpc.RpcError as err:
        typer.echo(f"error: {err.code().name}: {err.details()}", err=True)
        raise typer.Exit(2) from None


def _policy_json(p) -> dict:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(p, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _echo_json(obj) -> None:
    import json

    typer.echo(json.dumps(obj, indent=2, sort_keys=True))


@policy_app.command("list")
def policy_list(router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """Every stored policy."""
    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    resp = _call(stub.ListPolicies, policy_pb2.ListPoliciesRequest(), md)
    _echo_json([_policy_json(p) for p in resp.policies])


@policy_app.command("get")
def policy_get(workload_class: str = typer.Argument(..., help="Class name."),
               effective: bool = typer.Option(False, help="The policy in force with the controller's decision."),
               router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """A class's stored policy, or (--effective) what applies now and why."""
    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    if effective:
        resp = _call(stub.GetEffectivePolicy, policy_pb2.GetEffectivePolicyRequest(workload_class=workload_class), md)
    else:
        resp = _call(stub.GetPolicy, policy_pb2.GetPolicyRequest(workload_class=workload_class), md)
    _echo_json(_policy_json(resp))


_GUARD_SPEEDUP_OPT = typer.Option(
    None, "--guard-speedup", help="Stage slice: back to shadow when the controller's expected speedup S of the "
    "slice falls below this (1.0 by default; 0: off).")
_GUARD_ACCEPTED_OPT = typer.Option(
    None, "--guard-accepted", help="Stages slice and enabled: back one stage when the drafts accepted a round "
    "fall below this (0: off).")
_DRAFT_PRIORITY_OPT = typer.Option(
    None, "--draft-priority", min=0, max=9, help="0-9: a saturated draft replica sheds lower priorities' sessions "
    "first (ADR 0021).")
_SUFFIX_OPT = typer.Option(
    None, "--suffix", help="The class's suffix index and drafts (ADR 0026), as KEY=VALUE (repeat): max_requests "
    "(0: no index), max_tokens, min_prob, spec_factor.")
_SUFFIX_KEYS = {"max_requests": int, "max_tokens": int, "min_prob": float, "spec_factor": float}


def _suffix_numbers(items: list[str] | None) -> dict[str, float | int | None]:
    """`--suffix KEY=VALUE` options as the policy's suffix_* fields."""
    out: dict[str, float | int | None] = {}
    for item in items or ():
        key, _, value = item.partition("=")
        if key not in _SUFFIX_KEYS:
            raise typer.BadParameter(f"--suffix {item!r}: KEY is one of {', '.join(_SUFFIX_KEYS)}")
        try:
            out[f"suffix_{key}"] = _SUFFIX_KEYS[key](value)
        except ValueError:
            raise typer.BadParameter(f"--suffix {item!r}: {value!r} is not a number of that kind") from None
    return out


@policy_app.command("set")
def policy_set(
    workload_class: str = typer.Argument(..., help="Class name (`default` covers classes without a policy)."),
    mode: str | None = typer.Option(None, help="enabled | slice | shadow | off (slice: with --slice)"),
    pool: str | None = typer.Option(None, "--pool", help="Draft pool (the preferred one)."),
    also_pools: list[str] | None = typer.Option(
        None, "--also-pool", help="Another pool the controller may move the class to (repeat; '' clears)."),
    k: str | None = typer.Option(None, "--k", help="Draft tokens per round, or 'adaptive'."),
    k_min: int | None = typer.Option(None, help="Adaptive K lower bound."),
    k_max: int | None = typer.Option(None, help="Adaptive K upper bound."),
    temperature_ceiling: float | None = typer.Option(None, help="Requests above run plain (negative: no ceiling)."),
    max_prompt_tokens: int | None = typer.Option(None, help="Longer prompts run plain (0: no limit)."),
    margin: float | None = typer.Option(None, "--margin", help="Safety margin: speculate while S >= 1 + margin."),
    probe: float | None = typer.Option(None, "--probe", help="Probe fraction."),
    slice_percent: float | None = typer.Option(
        None, "--slice",
        help="Rollout stage slice: this percent of the class's requests speculate (sets --mode slice)."),
    promote_after: float | None = typer.Option(
        None, "--promote-after", help="Stage slice: promoted to enabled by itself after this many clean seconds "
        "(0: promotion is explicit)."),
    guard_tpot: float | None = typer.Option(
        None, "--guard-tpot", help="Stages slice and enabled: back one stage when the speculating requests' TPOT "
        "p90 exceeds this times the class's plain requests' (e.g. 1.2; 0: off)."),
    guard_errors: float | None = typer.Option(
        None, "--guard-errors", help="Stages slice and enabled: back one stage when the speculating requests' "
        "error rate exceeds the plain requests' by more than this (e.g. 0.02; 0: off)."),
    guard_speedup: float | None = _GUARD_SPEEDUP_OPT, guard_accepted: float | None = _GUARD_ACCEPTED_OPT,
    draft_priority: int | None = _DRAFT_PRIORITY_OPT, suffix: list[str] | None = _SUFFIX_OPT,
    output_format: str | None = typer.Option(
        None, "--output-format", help="text | json_object: the class's output when a request names no constraint."),
    from_file: Path | None = typer.Option(None, "--file", help="A JSON policy (fields as in `policy get`)."),
    expected_version: int | None = typer.Option(
        None, "--expected-version", help="Compare-and-set against this version (default: the version read)."),
    comment: str = typer.Option("", help="Kept in the audit log."),
    router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT,
) -> None:
    """Create or change a policy: reads the current one, applies the options, writes it back
    with compare-and-set, so a concurrent change is refused rather than lost."""
    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    policy, version = _current_policy(stub, md, workload_class)
    if from_file is not None:
        _read_policy_file(policy, from_file)
    policy.workload_class = workload_class
    if slice_percent is not None:  # a rollout slice (ADR 0022); another mode clears it
        mode = mode or "slice"
    elif mode is not None and mode != "slice":
        slice_percent = 0.0
    _apply_options(policy, mode, pool, also_pools, k, temperature_ceiling, output_format,
                   {"k_min": k_min, "k_max": k_max, "max_prompt_tokens": max_prompt_tokens,
                    "safety_margin": margin, "probe_fraction": probe, "slice_percent": slice_percent,
                    "promote_after_s": promote_after, "guard_max_tpot_ratio": guard_tpot,
                    "guard_max_error_rate": guard_errors, "guard_min_speedup": guard_speedup,
                    "guard_min_accepted": guard_accepted, "draft_priority": draft_priority, **_suffix_numbers(suffix)})
    req = policy_pb2.SetPolicyRequest(policy=policy, comment=comment,
                                      expected_version=version if expected_version is None else expected_version)
    _echo_json(_policy_json(_call(stub.SetPolicy, req, md)))


def _current_policy(stub, md, workload_class: str):
    """(a copy of the class's stored policy, its version), or a new class's defaults at version 0."""
    import grpc

    from specserve.v1 import policy_pb2

    try:
        current = stub.GetPolicy(policy_pb2.GetPolicyRequest(workload_class=workload_class), metadata=md, timeout=30)
        version = current.version
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.NOT_FOUND:
            typer.echo(f"error: {err.code().name}: {err.details()}", err=True)
            raise typer.Exit(2) from None
        from specserve.control.policy import Policy

        d = Policy(workload_class)  # a new class starts from the one set of policy defaults
        current = policy_pb2.Policy(workload_class=workload_class, mode=policy_pb2.POLICY_MODE_ENABLED,
                                    draft_pool=d.draft_pool, k=d.k, k_min=d.k_min, k_max=d.k_max,
                                    safety_margin=d.safety_margin, probe_fraction=d.probe_fraction,
                                    output_format=d.output_format)
        version = 0
    policy = policy_pb2.Policy()
    policy.CopyFrom(current)
    return policy, version


def _read_policy_file(policy, path: Path) -> None:
    """`--file`: a JSON policy (fields as in `policy get`) parsed onto the policy message; an
    unreadable file or an unknown field is a bad parameter."""
    import json

    from google.protobuf.json_format import ParseDict

    try:
        ParseDict(json.loads(path.read_text()), policy, ignore_unknown_fields=False)
    except Exception as exc:
        raise typer.BadParameter(f"{path}: {exc}") from exc


def _apply_options(policy, mode: str | None, pool: str | None, also_pools: list[str] | None, k: str | None,
                   temperature_ceiling: float | None, output_format: str | None,
                   numbers: dict[str, float | int | None]) -> None:
    """`policy set`'s options onto the policy message (an option left out changes nothing)."""
    from specserve.v1 import policy_pb2

    if mode is not None:
        modes = {"enabled": policy_pb2.POLICY_MODE_ENABLED, "shadow": policy_pb2.POLICY_MODE_SHADOW,
                 "off": policy_pb2.POLICY_MODE_OFF, "slice": policy_pb2.POLICY_MODE_SLICE}
        if mode not in modes:
            raise typer.BadParameter(f"--mode must be one of {', '.join(modes)}")
        policy.mode = modes[mode]
    if pool is not None:
        policy.draft_pool = pool
    if also_pools is not None:
        del policy.draft_pools[:]
        policy.draft_pools.extend(p for p in also_pools if p)
    if k is not None:
        if k == "adaptive":
            policy.adaptive_k = True
        elif k.isdigit():
            policy.adaptive_k, policy.k = False, int(k)
        else:
            raise typer.BadParameter("--k must be a number or 'adaptive'")
    for name, value in numbers.items():
        if value is not None:
            setattr(policy, name, value)
    if output_format is not None:
        policy.output_format = output_format
    if temperature_ceiling is not None:
        if temperature_ceiling < 0:
            policy.ClearField("temperature_ceiling")
        else:
            policy.temperature_ceiling = temperature_ceiling


@policy_app.command("delete")
def policy_delete(workload_class: str = typer.Argument(...),
                  expected_version: int | None = typer.Option(None, "--expected-version"),
                  comment: str = typer.Option(""),
                  router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """Remove a class's policy (it then falls under `default`)."""
    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    req = policy_pb2.DeletePolicyRequest(workload_class=workload_class, comment=comment)
    if expected_version is not None:
        req.expected_version = expected_version
    resp = _call(stub.DeletePolicy, req, md)
    typer.echo("deleted" if resp.deleted else f"no policy for {workload_class!r}")


@policy_app.command("history")
def policy_history(workload_class: str = typer.Argument("", help="Only this class (default: all)."),
                   limit: int = typer.Option(20, help="Newest entries to show."),
                   router: str | None = _ROUTER_OPT, token: str | None = _TOKEN_OPT) -> None:
    """The audit log, newest first: who changed what, when, old -> new."""
    import datetime

    from specserve.v1 import policy_pb2

    stub, md = _admin(router, token)
    resp = _call(stub.ListAudit, policy_pb2.ListAuditRequest(workload_class=workload_class, limit=limit), md)
    for e in resp.entries:
        when = datetime.datetime.fromtimestamp(e.at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        old = f"v{e.old.version}" if e.HasField("old") else "-"
        new = f"v{e.new.version}" if e.HasField("new") else "-"
        changes = _diff(_policy_json(e.old) if e.HasField("old") else {},
                        _policy_json(e.new) if e.HasField("new") else {})
        typer.echo(f"{when}Z  {e.action:<6} {e.workload_class:<12} {old} -> {new}  by {e.who} ({e.peer})"
                   f"{'  ' + e.comment if e.comment else ''}")
        for line in changes:
            typer.echo(f"    {line}")


def _diff(old: dict, new: dict) -> list[str]:
    skip = {"version", "updated_by", "updated_at", "workload_class"}
    return [f"{k}: {old.get(k, '-')} -> {new.get(k, '-')}" for k in sorted(set(old) | set(new))
            if k not in skip and old.get(k) != new.get(k)]
