"""The engine loop: requests, scheduler, sampler, and the step that ties them together."""
