"""Small runnable demos on the embedded model (`art demo --task brevity`)."""
