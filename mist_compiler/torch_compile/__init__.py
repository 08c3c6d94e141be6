"""``torch.compile(model, backend="mist")``: the dynamo backend (:mod:`.backend`, found through the
package's ``torch_dynamo_backends`` entry point) and, when options ask for training, the user's
loop run by a plan (:mod:`.plan_runtime`). Sits on the driver.
"""
