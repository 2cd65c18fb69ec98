"""``kvserving calibrate``: a model's KV sensitivity per token class, measured on
calibration text and written as the calibration file the engine config names."""
