"""corral.client"""
