//! placeholder
use super::*;
pub struct XmlRpc;
impl RpcSystem for XmlRpc {
    fn name(&self) -> &str { "xmlrpc" }
    fn supports(&self, case: &Case) -> bool { *case != Case::NullPolled }
    fn server(&self, _addr: &str, _case: &Case, _cpu: usize) -> Command { todo!() }
    fn client(&self, _addr: &str, _case: &Case, _cpu: usize, _t: Timing) -> Command { todo!() }
}
