"""Skip-softmax calibration: ModelOpt's checkpoint format (:mod:`.checkpoint`) and fitting it (:mod:`.fit`)."""

from .checkpoint import load_calibration, save_calibration
from .fit import SparsityCalibration, calibrate

__all__ = ["load_calibration", "save_calibration", "calibrate", "SparsityCalibration"]
