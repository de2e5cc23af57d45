"""Egress policies: a network namespace per policy sandbox, and the filter (corral's
resolver and proxy) every packet it sends goes through. See docs/network.md."""

from corral.runtime.net.manager import NetworkManager

__all__ = ["NetworkManager"]
