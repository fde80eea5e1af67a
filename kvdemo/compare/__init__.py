"""The same context and questions over several specs, side by side: the run (`run.compare`), one spec
measured (`measure`), what a comparison returns (`records`); which setting to deploy (`recommend`), over the specs an
engine stores (`candidates`), with what it found (`recommendation`), what the weights say beforehand (`weights`) and
the pick run in llama.cpp itself (`llama_cpp_check`)."""
