"""The methods that drive the engine: DCM, CMAP, HeadMap, fine-tuning, trajectories and knowledge circuits."""
