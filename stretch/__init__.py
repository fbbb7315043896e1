"""stretch: elastic stateful stream processing."""
