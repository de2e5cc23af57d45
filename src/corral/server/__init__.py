"""corral.server"""
