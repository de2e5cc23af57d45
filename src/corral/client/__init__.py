"""The Python SDK: blocking, asyncio and futures styles over one HTTP client.

Everything public is re-exported by :mod:`corral`; import it from there.
"""
