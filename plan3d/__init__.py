"""plan3d: plan, check and launch 3D-parallel (TP x PP x DP, ZeRO) training layouts."""
__version__ = "0.1.0"
