"""dflash_trainer: training for DFlash block drafters."""
__version__ = "0.1.0"
