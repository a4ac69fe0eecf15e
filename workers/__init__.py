"""Worker processes: one per device, each holding one loaded model."""
