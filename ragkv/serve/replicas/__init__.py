"""Replicas on Ray Serve: N engines behind Ray Serve's HTTP proxy, each request sent to the replica that holds most
of its blocks in memory (docs/deployment.md). Ray is imported only by deployment.py and router.py (the extra
`ragkv[replicas]`); the rest is plain Python the tests run without Ray."""
