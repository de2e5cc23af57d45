"""corral.rl"""
