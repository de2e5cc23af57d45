"""corral.runtime"""
