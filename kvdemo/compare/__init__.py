"""The same context and questions over several specs, side by side: the run (`run.compare`), one spec
measured (`measure`), and what a comparison returns (`records`)."""
