//! A lowering of the kernel language written outside the crate, as a contributor would add
//! one: it implements `Lower`, counts the ops of every kernel it lowers by kind, and delegates
//! the text to the interpret lowering. The KDA forward program with its kernels lowered by it
//! runs on the CPU plugin with results bitwise equal to the built-in interpret row's.

use std::collections::BTreeMap;
use std::sync::Mutex;

use kda_core::{BackwardStrategy, DType, HostTensor};
use kda_testkit::{case, case_data, rms_limit, Quantity};
use kda_tpu::hlo::{FnBuilder, Value};
use kda_tpu::lang::{Interpret, Kernel, Lower, OpKind};
use kda_tpu::op::{index_tables_for, program, program_lowered_by, ProgramKind, ProgramSignature};
use kda_tpu::{DeviceBuffer, Implementation, PjrtBackend, Runtime, Tuning};

/// Op counts by kind name, per kernel name: through `Kernel::walk`, and from the kernel's
/// `Debug` text.
type Counts = BTreeMap<String, (BTreeMap<String, usize>, BTreeMap<String, usize>)>;

/// Counts each lowered kernel's ops through `Kernel::walk`; the text is the interpret
/// lowering's.
#[derive(Debug, Default)]
struct Counting {
    counts: Mutex<Counts>,
}

impl Lower for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    fn check(&self, kernel: &Kernel) -> kda_tpu::Result<()> {
        Interpret::default().check(kernel)
    }
    fn text(&self, kernel: &Kernel) -> kda_tpu::Result<String> {
        kernel.module(self)
    }
    fn call(&self, kernel: &Kernel, f: &mut FnBuilder, operands: &[Value]) -> kda_tpu::Result<Vec<Value>> {
        let mut by_kind = BTreeMap::new();
        kernel.walk(&mut |kind: OpKind| *by_kind.entry(format!("{kind:?}")).or_insert(0) += 1);
        let independent = counted_from_debug(kernel);
        self.counts.lock().expect("not poisoned").insert(kernel.name().to_string(), (by_kind, independent));
        Interpret::default().call(kernel, f, operands)
    }
}

/// Every op of the language by the name its `Debug` form starts with: the list this test keeps
/// itself, so that a kind the walk skips or misnames shows as a difference.
const OP_NAMES: [&str; 23] = [
    "ProgramId",
    "IndexConst",
    "IndexBinary",
    "ReadTable",
    "Splat",
    "Load",
    "Store",
    "Matmul",
    "Binary",
    "Unary",
    "Iota",
    "Compare",
    "Select",
    "Reduce",
    "Cumsum",
    "Broadcast",
    "Cast",
    "Transpose",
    "Reshape",
    "Slice",
    "Concat",
    "If",
    "For",
];

/// The ops of `kernel` counted from its `Debug` text (each op prints as `Name { .. }`, its
/// regions' ops inside it), independently of `Kernel::walk`.
fn counted_from_debug(kernel: &Kernel) -> BTreeMap<String, usize> {
    let text = format!("{kernel:?}");
    let body = &text[text.find("body: [").expect("the kernel's body")..];
    let mut counts = BTreeMap::new();
    for name in OP_NAMES {
        let pattern = format!("{name} {{");
        let n = body
            .match_indices(&pattern)
            .filter(|(at, _)| !body[..*at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_'))
            .count();
        if n > 0 {
            counts.insert(name.to_string(), n);
        }
    }
    counts
}

/// The program's outputs on `inputs`, run on the CPU plugin.
fn run(rt: &Runtime, text: &str, inputs: &[DeviceBuffer]) -> Vec<Vec<u32>> {
    let exe = rt.compile(text).expect("the program compiles");
    let refs: Vec<&DeviceBuffer> = inputs.iter().collect();
    let outs = rt.execute(&exe, &refs).expect("the program runs");
    outs.iter()
        .map(|b| rt.download_f32(b).expect("f32 results").iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn an_outside_lowering_runs_the_forward_bitwise_as_the_interpret_row() {
    let c = case("packed_rows_differ").expect("case in the table");
    let d = case_data(&c, DType::F32).expect("case data");
    let problem = d.inputs.validate().expect("valid");
    let tuning = Tuning::for_platform("cpu").with_implementation(Implementation::Interpret);
    let be = PjrtBackend::new()
        .expect("PJRT plugin (run `cargo xtask setup`)")
        .with_tuning(tuning)
        .expect("tuning");
    let spec = be.spec(&problem, c.final_state).expect("spec");
    let kind = ProgramKind::Forward(BackwardStrategy::Rematerialize);

    let counting = Counting::default();
    let theirs = program_lowered_by(&spec, kind, &counting).expect("lowered by the outside lowering");
    let ours = program(&spec, kind).expect("the interpret row's program");

    // The arguments by name: the caller's tensors (every kernel form is their row-major data),
    // the index tables from the host.
    let rt = Runtime::new().expect("CPU plugin");
    let tables = index_tables_for(&spec, &problem.segments).expect("index tables");
    let sig = ProgramSignature::of(&spec, kind);
    let inputs: Vec<DeviceBuffer> = sig
        .args
        .iter()
        .map(|port| {
            let x = &d.inputs;
            let tensor: Option<&HostTensor> = match port.name {
                "q" => Some(&x.q),
                "k" => Some(&x.k),
                "v" => Some(&x.v),
                "g" => Some(&x.g),
                "beta" => Some(&x.beta),
                "h0" => x.initial_state.as_ref(),
                _ => None,
            };
            match (tensor, tables.iter().find(|t| t.name == port.name)) {
                (Some(t), _) => rt.upload_f32(&t.to_f32_vec(), &port.ty.dims),
                (None, Some(t)) => rt.upload_i32(&t.data, &t.dims),
                (None, None) => panic!("no data for argument {}", port.name),
            }
            .expect("upload")
        })
        .collect();
    let (got, want) = (run(&rt, &theirs, &inputs), run(&rt, &ours, &inputs));
    assert_eq!(got, want, "the outside lowering's program gives the interpret row's bits");

    // And those bits are KDA's forward: `o` against the f64 reference.
    let o = HostTensor::from_f32(d.inputs.v.shape(), got[0].iter().map(|&b| f32::from_bits(b)).collect())
        .expect("o");
    let reference = kda_testkit::reference::forward_and_vjp("packed_rows_differ-f32", &d).expect("reference");
    let agreement = kda_testkit::agreement(&o, &reference.0.o.to_f64_vec());
    let limit = rms_limit(Quantity::Output, DType::F32);
    assert!(agreement.rms_ratio <= limit, "o: rms ratio {:.3e} over {limit:.0e}", agreement.rms_ratio);

    let counts = counting.counts.into_inner().expect("not poisoned");
    assert!(counts.len() >= 2, "the masks kernel and the forward kernel: {counts:?}");
    let forward = counts.keys().find(|k| k.contains("forward")).expect("the forward kernel was lowered");
    assert!(counts[forward].0.get("Matmul").is_some_and(|&n| n > 0), "{counts:?}");
    for (kernel, (walked, independent)) in &counts {
        assert_eq!(walked, independent, "{kernel}: the walk against the body's own list");
        println!("{kernel}: {walked:?}");
    }
}
