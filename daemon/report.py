"""``tfelastic report``: the job's goodput ledger as a timeline, a line per generation, then the totals. It asks the
job's coordinator, as ``status`` does; with an etcd rendezvous and no coordinator (the job ended, or one is being
elected) it reads the job's state that the coordinators write to etcd, which holds the same ledger."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import grpc
from tfelastic.daemon.commands import OperatorError, describe_rpc_error, find_coordinator
from tfelastic.daemon.config import OperatorConfig
from tfelastic.daemon.endpoint import Endpoint
from tfelastic.daemon.exit_codes import ExitCode
from tfelastic.daemon.preflight import check_tls_files
from tfelastic.daemon.rendezvous.api import GenerationSummary, GoodputView
from tfelastic.daemon.rendezvous.durable import DurableState
from tfelastic.daemon.rendezvous.goodput import ledger_of_export
from tfelastic.daemon.status import goodput_json, render_report, status_to_json, timeline_json


def run_report(config: OperatorConfig, token: str | None, *, as_json: bool) -> int:
    check_tls_files(config.rendezvous.tls)
    try:
        doc = _from_coordinator(config, token)
    except _NoCoordinator as e:
        if config.rendezvous.etcd is None:
            raise OperatorError(str(e)) from None
        doc = _from_etcd(config)
    if as_json:
        print(json.dumps(doc, indent=2), flush=True)
    else:
        print(render_report(doc, doc["generations"]), flush=True)
    return ExitCode.SUCCEEDED


class _NoCoordinator(Exception):
    pass


def _from_coordinator(config: OperatorConfig, token: str | None) -> dict[str, Any]:
    from tfelastic.daemon.rendezvous.client import fetch_status

    rdzv = config.rendezvous
    try:
        endpoint = rdzv.endpoint if isinstance(rdzv.endpoint, Endpoint) else find_coordinator(config)
        snapshot = asyncio.run(fetch_status(endpoint, token, rdzv.tls))
    except OperatorError as e:
        raise _NoCoordinator(str(e)) from None
    except grpc.RpcError as e:
        if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise OperatorError(describe_rpc_error("report", endpoint, e)) from None
        raise _NoCoordinator(describe_rpc_error("report", endpoint, e, tls=rdzv.tls.enabled)) from None
    doc = status_to_json(snapshot)
    return {**doc, "source": "coordinator", "generations": timeline_json(snapshot.goodput)}


def _from_etcd(config: OperatorConfig) -> dict[str, Any]:
    from tfelastic.daemon.etcd.client import EtcdClient, EtcdError
    from tfelastic.daemon.etcd.election import Election
    from tfelastic.daemon.preflight import etcd_credentials

    target = config.rendezvous.etcd
    assert target is not None

    async def read() -> DurableState | None:
        client = EtcdClient(target, etcd_credentials(config.rendezvous))
        try:
            return await Election(client, config.job, config.rendezvous.lease_ttl).recorded_state()
        except EtcdError as e:
            raise OperatorError(f"etcd at {target} does not answer: {e}") from None
        finally:
            await client.close()

    recorded = asyncio.run(read())
    if recorded is None:
        raise OperatorError(f"etcd at {target} holds no state of job {config.job!r} (--job names it)")
    view = _view(recorded)
    return {"job": config.job, "state": recorded.state.value, "reason": recorded.reason, "source": "etcd",
            "goodput": goodput_json(view), "generations": timeline_json(view)}


def _view(recorded: DurableState) -> GoodputView | None:
    if recorded.goodput is None:
        return None
    ledger = ledger_of_export(recorded.goodput, time.time())
    return GoodputView(ledger.now_totals(), tuple(GenerationSummary(
        line.generation, line.formed_at, line.size, line.members, line.restored_step, line.startup_seconds,
        line.steps_redone, line.ended, line.seconds) for line in ledger.lines_now()), ledger.steps_redone)
