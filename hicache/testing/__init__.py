"""The test and benchmark harness, shipped with the package so that users may run it too:
real L3 servers on loopback (`local_servers`: Redis, a Redis Cluster, a Mooncake master), two
test hosts as network namespaces joined by a veth pair (`netns_hosts`), fault-injecting
backends (`faulty_storage.FaultyBackend` for L3, `fake_copies.FakeCopyBackend` for copies),
and the real sidecar on that fake copy backend (`serve`: `python -m hicache.testing.serve`).

It stands above the product: it may import any of it (`serve` imports the service), and no
module of the product imports it (`tests/test_import_rules.py`), so nothing a deployment runs
reads a test switch. Each module's docstring states its objects' lifecycle; servers and hosts
are stopped by whoever started them (`stop` / `close`, or a `with` block).
"""
