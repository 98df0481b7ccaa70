"""Layer 4: control-plane collectives (JSON over gloo, timeouts, agreed errors) and the
replica broadcast data plane."""
