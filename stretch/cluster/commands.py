"""The ``stretch cluster`` commands (status, add-node, remove-node): they ask a stretch cluster's
nodes and its driver over Arrow Flight, and say in one line what did not answer."""

from __future__ import annotations

import json

from pyarrow import flight

from stretch.cluster.client import ClusterConnection, NodeUnreachable


def connect(address: str) -> ClusterConnection:
    """A connection to the cluster at ``address``; a cluster that is not there exits, saying so."""
    try:
        return ClusterConnection(address)
    except (OSError, LookupError, ValueError) as e:
        raise SystemExit(f"stretch: no stretch cluster at {address}: {e}") from None


def status(args) -> int:
    """Each node of the cluster at ADDRESS: its routing version, key groups and jobs."""
    connection = connect(args.address)
    try:
        table = connection.routing()
        nodes = {n: connection.action(n, "status") for n in connection.locations()}
    except NodeUnreachable as e:  # it says which node
        raise SystemExit(f"stretch: {first_line(e)}") from None
    except (LookupError, OSError, flight.FlightError) as e:  # a cluster given by its driver's URL
        raise SystemExit(f"stretch: {_driver_gone(args.address, e)}") from None
    finally:
        connection.close()
    if args.json:
        print(json.dumps({"version": table.version if table else None, "nodes": nodes}))
        return 0
    print(f"routing version {table.version if table else '-'}, {len(nodes)} nodes")
    for node, status in nodes.items():
        running = (
            ", ".join(f"{name} ({job.get('status')})" for name, job in status["jobs"].items()) or "no jobs"
        )
        print(
            f"  {node:10} version {status['version']:<4} {len(status['key_groups']):5} key groups   {running}"
        )
    return 0


def change(args) -> int:
    """add-node / remove-node: the cluster's driver moves the key groups; prints its HandoffReport."""
    connection = connect(args.address)
    try:
        if args.cluster_command == "add-node":
            report = connection.driver_action("add_node")
        else:
            report = connection.driver_action("remove_node", {"node": args.node})
    except LookupError as e:
        raise SystemExit(f"stretch: {e}") from None
    except (OSError, flight.FlightError) as e:
        raise SystemExit(f"stretch: {_driver_gone(args.address, e)}") from None
    finally:
        connection.close()
    if not report.pop("ok"):
        raise SystemExit(f"stretch: {report['error']}")
    if args.json:
        print(json.dumps(report))
        return 0
    print(
        f"{args.cluster_command}: moved {report['key_groups_moved']} key groups ({report['bytes_moved']:,} state "
        f"bytes) in {report['elapsed_ms']:.1f} ms over {report['steps']} steps; longest stall "
        f"{report['max_stall_ms']:.1f} ms; routing version {report['version']}"
    )
    return 0


def _driver_gone(address: str, e: Exception) -> str:
    if not isinstance(e, flight.FlightUnavailableError):
        return first_line(e)
    return (
        f"the driver of the cluster at {address} does not answer (has the process holding its "
        f"StretchCluster ended?): {first_line(e)}"
    )


def first_line(e: Exception) -> str:
    """An error's first line: gRPC's go on with details for developers."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
